"""One statistics type for a request, shared by the API, the server and the bench."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Iterable

MAX_DEPTH = 3


@dataclass
class GenStats:
    """What one generation did and where its time went.

    Depth d (1-based) counts the d-th draft token of a round: ``drafted_per_depth[d-1]``
    rounds drafted at least d tokens, ``accepted_per_depth[d-1]`` of them had their
    first d drafts accepted.
    """

    n_prompt: int = 0
    #: prompt tokens whose KV was reused from the slot's previous request (not decoded)
    n_prompt_cached: int = 0
    n_predicted: int = 0
    n_drafted: int = 0
    n_accepted: int = 0
    #: of those, the drafts taken from the context (``drafters``: a copy of earlier text)
    n_drafted_context: int = 0
    n_accepted_context: int = 0
    drafted_per_depth: list[int] = field(default_factory=lambda: [0] * MAX_DEPTH)
    accepted_per_depth: list[int] = field(default_factory=lambda: [0] * MAX_DEPTH)
    n_rounds: int = 0
    #: rounds by number of drafts (0 .. MAX_DEPTH): what the draft lengths were
    rounds_by_length: list[int] = field(default_factory=lambda: [0] * (MAX_DEPTH + 1))
    n_target_decodes: int = 0
    n_draft_decodes: int = 0
    #: of those, the decodes made while the prompt was decoded (its chunks)
    n_prompt_target_decodes: int = 0
    n_prompt_draft_decodes: int = 0
    #: rows (tokens) those decodes carried
    n_target_rows: int = 0
    n_draft_rows: int = 0
    t_prompt_ms: float = 0.0
    t_gen_ms: float = 0.0
    #: time inside llama.cpp calls (decodes and reading their outputs), prompt and generation
    t_llama_ms: float = 0.0
    #: of that, the heads' (their decodes and outputs)
    t_draft_ms: float = 0.0

    @property
    def t_python_ms(self) -> float:
        """Time spent in Python outside llama.cpp calls."""
        return max(0.0, self.t_prompt_ms + self.t_gen_ms - self.t_llama_ms)

    @property
    def accept_rate(self) -> float:
        return self.n_accepted / self.n_drafted if self.n_drafted else 0.0

    @property
    def tokens_per_second(self) -> float:
        return 1000.0 * self.n_predicted / self.t_gen_ms if self.t_gen_ms > 0 else 0.0

    def count_round(self, n_drafted: int, n_accepted: int, n_context: int = 0) -> None:
        """A round's drafts, the first ``n_context`` of them the context's (counted in
        the totals and in ``*_context``; the depths count the heads' drafts alone)."""
        self.n_rounds += 1
        self.rounds_by_length[min(n_drafted, MAX_DEPTH)] += 1
        self.n_drafted += n_drafted
        self.n_accepted += n_accepted
        if n_context:
            self.n_drafted_context += n_context
            self.n_accepted_context += min(n_accepted, n_context)
        for d in range(n_context, min(n_drafted, MAX_DEPTH)):
            self.drafted_per_depth[d] += 1
            if d < n_accepted:
                self.accepted_per_depth[d] += 1

    @classmethod
    def total(cls, stats: Iterable["GenStats"]) -> "GenStats":
        """The sum of several generations' statistics (counts, per-depth counts and times)."""
        out = cls()
        for st in stats:
            for f in fields(cls):
                mine, theirs = getattr(out, f.name), getattr(st, f.name)
                if isinstance(mine, list):
                    setattr(out, f.name, [a + b for a, b in zip(mine, theirs)])
                else:
                    setattr(out, f.name, mine + theirs)
        return out

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["t_python_ms"] = self.t_python_ms
        d["accept_rate"] = self.accept_rate
        d["tokens_per_second"] = self.tokens_per_second
        return d
