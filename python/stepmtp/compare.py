"""``python -m stepmtp --compare``: the same prompts without speculation, with the single
head and with the chained heads; the text each made, the target decodes each took, and
what a chained round costs against the plain decodes it replaces, on the model run and
on Step-3.5-Flash.

Speculation saves target decodes, never text: a round drafts tokens with the heads and
the target verifies them all in one decode, keeping those it would have picked itself.
Whether that saves time depends on costs: a round pays a verify of several rows, a
decode of each head used and Python's orchestration, for the plain decodes it replaces.
On Step-3.5-Flash a head reads 0.07 of what the target reads and Python's share is small
next to a decode; on the bundled 4 MB model a decode takes a fraction of a millisecond,
and the heads and Python weigh as much as the decodes saved.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from .slots import Completion
from .stats import GenStats

#: what each mode's row is called
LABELS = {"none": "none (plain decoding)", "single": "single head", "chain": "chain of heads"}

#: models up to this size are loaded again for each run of the prompts, the modes taking
#: turns, so that a machine busy for a while slows every mode alike (each engine holds its
#: own weights: all three at once took 10 GB for the bench-size model); a larger one
#: (Step-3.5-Flash itself) is loaded once per mode
RELOAD_MAX_BYTES = 8 << 30


@dataclass
class ModeRun:
    """One mode's generations over the prompts (the fastest of the repeats of each)."""

    mode: str
    n_max: int
    completions: list[Completion] = field(default_factory=list)
    kv_mib: tuple[float, float] = (0.0, 0.0)
    #: the draft length chosen each round, up to n_max
    adaptive: bool = False

    @property
    def label(self) -> str:
        if self.mode == "none":
            return LABELS["none"]
        return LABELS.get(self.mode, self.mode) + f", {'up to ' if self.adaptive else ''}{self.n_max} drafts"

    @property
    def texts(self) -> list[str]:
        return [c.text for c in self.completions]

    @property
    def tokens(self) -> list[list[int]]:
        return [c.tokens for c in self.completions]

    @property
    def stats(self) -> GenStats:
        return GenStats.total(c.stats for c in self.completions)

    @property
    def target_decodes(self) -> int:
        """The rounds and one decode per prompt, which makes its first token (llama.cpp
        may take a prompt in several decodes: as many in every mode)."""
        return self.rounds + len(self.completions)

    @property
    def tokens_per_decode(self) -> float:
        return self.stats.n_predicted / self.target_decodes if self.target_decodes else 0.0

    @property
    def rounds(self) -> int:
        """Target decodes after the prompt's: one a round (one a token without speculation)."""
        st = self.stats
        return st.n_target_decodes - st.n_prompt_target_decodes

    @property
    def round_tokens(self) -> int:
        """Tokens the rounds made: each prompt's first token comes from its own decode."""
        return sum(max(0, c.stats.n_predicted - 1) for c in self.completions)

    @property
    def tokens_per_round(self) -> float:
        return self.round_tokens / self.rounds if self.rounds else 0.0

    @property
    def verify_rows(self) -> float:
        """Rows a round's verify carries: the last token and the drafts."""
        st = self.stats
        return 1 + st.n_drafted / st.n_rounds if st.n_rounds else 1.0

    @property
    def head_decodes_per_round(self) -> float:
        st = self.stats
        return (st.n_draft_decodes - st.n_prompt_draft_decodes) / self.rounds if self.rounds else 0.0

    @property
    def python_ms_per_round(self) -> float:
        return self.stats.t_python_ms / self.rounds if self.rounds else 0.0


def run_modes(open_engine: Callable[[str, bool], Any], modes: Sequence[str], n_max: int, prompts: Sequence[str],
              generate_kw: Mapping[str, Any], *, repeat: int = 1, reload: bool = True,
              adaptive: bool = False) -> dict[str, ModeRun]:
    """Each prompt in each mode ``repeat`` times, keeping each prompt's fastest
    generation per mode. ``open_engine(mode, first)`` makes an Engine (``first``: the
    first one opened); ``reload``: the modes take turns, an engine opened for each run of
    the prompts, else each mode runs all its repeats on one engine."""
    runs = {m: ModeRun(m, n_max if m != "none" else 0, [None] * len(prompts), adaptive=adaptive and m != "none")
            for m in modes}
    first = True

    def run(mode: str, times: int) -> None:
        nonlocal first
        with open_engine(mode, first) as eng:
            first = False
            # a first touch of every weight (page faults, a GPU's warm-up) is not timed
            eng.generate(prompts[0], n_predict=4, temperature=0, cache_prompt=False)
            mem = eng.memory()
            runs[mode].kv_mib = (mem["target"]["kv"] / 2**20, mem["draft"]["kv"] / 2**20)
            for _ in range(times):
                for i, prompt in enumerate(prompts):
                    out = eng.generate(prompt, **generate_kw)
                    best = runs[mode].completions[i]
                    if best is None or out.stats.t_gen_ms < best.stats.t_gen_ms:
                        runs[mode].completions[i] = out

    if reload:
        for _ in range(repeat):
            for m in modes:
                run(m, 1)
    else:
        for m in modes:
            run(m, repeat)
    return runs


def same_tokens(runs: Mapping[str, ModeRun]) -> bool:
    return len({tuple(map(tuple, r.tokens)) for r in runs.values()}) == 1


def decodes_table(runs: Sequence[ModeRun]) -> list[str]:
    """Tokens, target decodes, tokens per target decode and acceptance (all and per
    depth) of each mode."""
    head = ("", "tokens", "target decodes", "tokens/decode", "drafts accepted", "by depth 1 / 2 / 3")
    rows = [head]
    for r in runs:
        st = r.stats
        if st.n_drafted:
            acc = f"{st.n_accepted}/{st.n_drafted} {st.accept_rate:4.0%}"
            depth = " / ".join(f"{a / n:.0%}" if n else "-" for a, n in zip(st.accepted_per_depth,
                                                                             st.drafted_per_depth))
        else:
            acc = depth = "-"
        rows.append((r.label, str(st.n_predicted), str(r.target_decodes), f"{r.tokens_per_decode:.2f}", acc, depth))
    return _columns(rows, left=(0, 5))


def time_table(runs: Sequence[ModeRun]) -> list[str]:
    """Where each mode's time went: the prompts' decodes, then generating: the target's
    decodes, the heads', Python (whose prompt share, a tokenization, is counted there);
    tokens a second while generating, against plain decoding's."""
    stats = [r.stats for r in runs]
    rows = [("ms", *(r.mode for r in runs))]
    parts = (("the prompts' decodes", lambda st: st.t_prompt_ms),
             ("generating: the target's decodes", lambda st: st.t_llama_ms - st.t_draft_ms - st.t_prompt_ms),
             ("            the heads' decodes", lambda st: st.t_draft_ms),
             ("            Python", lambda st: st.t_python_ms),
             ("            all", lambda st: st.t_gen_ms))
    for name, part in parts:
        rows.append((name, *(f"{part(st):.1f}" if st.n_drafted or "heads" not in name else "-" for st in stats)))
    rows.append(("tokens a second, generating", *(f"{st.tokens_per_second:.0f}" for st in stats)))
    plain = stats[0].tokens_per_second
    rows.append(("speed, x plain decoding", *(f"{st.tokens_per_second / plain:.2f}x" if plain else "-"
                                              for st in stats)))
    return _columns(rows, left=(0,))


def _columns(rows: Sequence[Sequence[str]], left: Sequence[int]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()
            for row in rows]


def verify_cost(ratios: Mapping[str, float], rows: float, key: str) -> float:
    """A ``rows``-row target decode in 1-row decodes, linear between the row counts
    measured (``key`` formats a row count into the ratio's name)."""
    known = {1: 1.0, **{k: ratios[key.format(k)] for k in (2, 3, 4) if key.format(k) in ratios}}
    ks = sorted(known)
    rows = min(max(rows, ks[0]), ks[-1])
    for lo, hi in zip(ks, ks[1:]):
        if rows <= hi:
            return known[lo] + (known[hi] - known[lo]) * (rows - lo) / (hi - lo)
    return known[ks[-1]]


def head_cost(decode_costs: Mapping[str, float]) -> float:
    """The mean head decode in 1-row target decodes (``bench.flash.measure_costs``)."""
    heads = [v for k, v in decode_costs.items() if k.startswith("head") and k.endswith("/target1")]
    return sum(heads) / len(heads) if heads else 0.0


def flash_speed(chain: ModeRun, flash: Mapping[str, float]) -> tuple[float, float]:
    """A chained round's cost on Step-3.5-Flash, in its 1-row decodes (a verify of the
    chain's rows and its heads' decodes; ``bench.flash.estimate_costs``: memory-bound,
    from its published configuration; Python's fraction of a millisecond is nothing next
    to its decodes), and the speed it gives at the chain's tokens a round."""
    cost = verify_cost(flash, chain.verify_rows, "verify{}/target1") + chain.head_decodes_per_round * flash["head/target1"]
    return cost, chain.tokens_per_round / cost


def model_line(path: Path, model: Any, n_heads: int, bundled: bool, bench: bool) -> str:
    what = ("the bundled model, trained on CPython's standard library" if bundled and not bench else
            "the bench-size variant: its predictions with Step-3.5-Flash's cost shape" if bench else "")
    size = f"{model.n_params / 1e6:.1f} M parameters, {model.size / 2**20:.0f} MiB"
    return f"model: {path.name} ({', '.join(x for x in (what, size) if x)}), MTP heads: {n_heads}"
