"""The benchmark loop: every configuration on every prompt, interleaved.

Configurations run prompt by prompt (for each prompt, each configuration in turn, the
order rotated from one prompt to the next), so drift of the machine (other load,
frequency, thermals) lands on all of them alike and cancels in their ratios.
"""
from __future__ import annotations

import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from .prompts import PromptSet
from .runners import BenchConfig, Result, Runner

__all__ = ["ConfigRun", "BenchRun", "run_bench", "Progress"]


@dataclass
class ConfigRun:
    config: BenchConfig
    #: one per prompt, in the set's order; times are the best of the repeats
    results: list[Result] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    #: categories whose counts or text differed between repeats (should never happen at temp 0)
    unstable: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return self.config.label


@dataclass
class Mismatch:
    category: str
    label: str
    reference: str
    #: first differing character
    at: int
    #: first differing token (None when a backend does not return tokens)
    token_at: int | None = None


@dataclass
class BenchRun:
    prompts: PromptSet
    configs: list[ConfigRun]
    settings: dict[str, Any]
    model: dict[str, Any] = field(default_factory=dict)
    environment: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0
    mismatches: list[Mismatch] = field(default_factory=list)

    def by_label(self) -> dict[str, ConfigRun]:
        return {c.label: c for c in self.configs}


class Progress:
    """Progress on stderr: one line per request (rewritten in place on a terminal)."""

    def __init__(self, total: int, stream: Any = None, enabled: bool = True) -> None:
        self.total = total
        self.n = 0
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.perf_counter()

    def note(self, msg: str) -> None:
        if self.enabled:
            self._clear()
            print(f"bench: {msg}", file=self.stream, flush=True)

    def step(self, r: Result) -> None:
        self.n += 1
        if not self.enabled:
            return
        el = time.perf_counter() - self.t0
        eta = el / self.n * (self.total - self.n)
        line = (f"bench [{self.n:3d}/{self.total}] {r.category:<18} {r.label:<14} pred={r.predicted:4d} "
                f"rate={r.rate:.3f} {r.tok_s:8.1f} tok/s  ({el:.0f} s, ~{eta:.0f} s left)")
        if self.tty:
            print("\r" + line[:150].ljust(150), end="", file=self.stream, flush=True)
        else:
            print(line, file=self.stream, flush=True)

    def done(self) -> None:
        self._clear()

    def _clear(self) -> None:
        if self.tty and self.n:
            print("\r" + " " * 150 + "\r", end="", file=self.stream, flush=True)


def agreement(run: "BenchRun") -> dict[str, dict[str, Any]]:
    """How far each temperature-0 configuration agrees with the first one, for backends
    whose kernels legitimately round differently with the rows a decode carries (GPU):
    the share of prompts with identical text, and the tokens (or characters, when a
    backend returns no tokens) until the first difference of those that differ."""
    greedy = [c for c in run.configs if c.config.temperature == 0]
    out: dict[str, dict[str, Any]] = {}
    for c in greedy[1:]:
        diffs = [m for m in run.mismatches if m.label == c.label]
        n = len(c.results)
        tok = [m.token_at for m in diffs if m.token_at is not None]
        out[c.label] = {"identical": round((n - len(diffs)) / n, 4) if n else 1.0, "differing": len(diffs),
                        "tokens_until_difference": sorted(tok) if len(tok) == len(diffs) else None,
                        "chars_until_difference": sorted(m.at for m in diffs)}
    return out


def _first_diff(a: Sequence[Any], b: Sequence[Any]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def _merge(rs: list[Result], timed_counts: bool = False) -> tuple[Result, bool]:
    """One Result from repeats: counts and text of the first, the best (lowest) times
    (interference from other load only ever adds time), every repeat's time; and
    whether the repeats disagreed on text, or on counts unless ``timed_counts`` (an
    adaptive length drafts by measured times, so its counts vary; its text may not)."""
    r0 = rs[0]
    if len(rs) == 1:
        return r0, False
    stable = all(r.text == r0.text and (timed_counts or r.counts() == r0.counts()) for r in rs[1:])
    m = Result(**{**r0.__dict__})
    best = min(rs, key=lambda r: r.gen_ms)
    m.gen_ms, m.prompt_ms, m.t_python_ms = best.gen_ms, best.prompt_ms, best.t_python_ms
    m.wall_s = min(r.wall_s for r in rs)
    m.gen_ms_repeats = [r.gen_ms for r in rs]
    return m, not stable


def run_bench(prompts: PromptSet, runners: Sequence[Runner], *, repeat: int = 1, warmup: int = 1,
              settings: dict[str, Any] | None = None, progress: bool = True,
              on_result: Callable[[Result], None] | None = None) -> BenchRun:
    """Run every prompt on every runner (started here, closed at the end, Ctrl-C
    included), interleaved; check that the texts agree across configurations."""
    if not runners:
        raise ValueError("no configuration to run")
    labels = [r.config.label for r in runners]
    if len(set(labels)) != len(labels):
        raise ValueError(f"configurations must differ: {labels}")
    repeat = max(1, repeat)
    prog = Progress(len(prompts) * len(runners) * repeat, enabled=progress)
    t_start = time.perf_counter()
    with ExitStack() as stack:
        for r in runners:
            prog.note(f"starting {r.config.label}: {r.config.describe()}")
            stack.enter_context(r)
        if warmup > 0 and len(prompts):
            p0 = prompts.prompts[0]
            prog.note(f"warm-up: {warmup} x {min(16, p0.n_predict)} tokens per configuration")
            for _ in range(warmup):
                for r in runners:
                    r.run(p0.category, p0.prompt, min(16, p0.n_predict))
        raw: dict[str, dict[str, list[Result]]] = {lab: {} for lab in labels}
        k = len(runners)
        step = 0
        for p in prompts.prompts:
            for _ in range(repeat):
                order = [runners[(step + j) % k] for j in range(k)]
                step += 1
                for r in order:
                    res = r.run(p.category, p.prompt, p.n_predict)
                    raw[r.config.label].setdefault(p.category, []).append(res)
                    prog.step(res)
                    if on_result:
                        on_result(res)
        infos = {r.config.label: r.info() for r in runners}
    prog.done()

    runs = []
    for r in runners:
        cr = ConfigRun(r.config, info=infos[r.config.label])
        for p in prompts.prompts:
            m, unstable = _merge(raw[r.config.label][p.category], timed_counts=r.config.adaptive)
            cr.results.append(m)
            if unstable:
                cr.unstable.append(p.category)
        runs.append(cr)
    out = BenchRun(prompts, runs, dict(settings or {}), wall_s=time.perf_counter() - t_start)
    out.settings.setdefault("repeat", repeat)
    out.settings.setdefault("warmup", warmup)
    out.mismatches = check_texts(out)
    return out


def check_texts(run: BenchRun) -> list[Mismatch]:
    """At temperature 0 every configuration must produce the same text (sampled
    configurations are left out: exact and rejection verification draw differently)."""
    greedy = [c for c in run.configs if c.config.temperature == 0]
    if not greedy:
        return []
    ref = greedy[0]
    out = []
    for c in greedy[1:]:
        for a, b in zip(ref.results, c.results):
            if a.text != b.text:
                at_tok = (_first_diff(a.tokens, b.tokens) if a.tokens is not None and b.tokens is not None
                          else None)
                out.append(Mismatch(a.category, c.label, ref.label, _first_diff(a.text, b.text), at_tok))
    return out
