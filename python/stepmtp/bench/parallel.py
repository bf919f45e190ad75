"""``--parallel N``: aggregate throughput of N concurrent clients against one client.

For each configuration, an engine (or a server, with ``--server``) with 1 slot and
one with N slots run the whole prompt set, the first with one client, the second
with N clients taking prompts from a shared queue; the two alternate ``repeat``
times and the best wall time of each is kept. Aggregate tok/s = generated tokens /
wall time. At temperature 0 every prompt must give the same text in both.
"""
from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from .prompts import Prompt
from .runners import BenchConfig, EngineRunner, Result, Runner, ServerRunner, run_clients


@dataclass
class ParallelRun:
    config: str
    clients: int
    wall_s: float = float("inf")
    results: list[Result] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(r.predicted for r in self.results)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def rate(self) -> float:
        d = sum(r.drafted for r in self.results)
        return sum(r.accepted for r in self.results) / d if d else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config, "clients": self.clients, "requests": len(self.results),
                "tokens": self.tokens, "wall_s": self.wall_s, "tok_s": self.tok_s, "accept_rate": self.rate}


def _runner(c: BenchConfig, model: Path, n: int, *, mtp_model: str | None, n_ctx: int,
            n_threads: int | None, server: bool) -> Runner:
    if server:
        return ServerRunner(dataclasses.replace(c, backend="server"), model,
                            mtp_model=mtp_model, n_ctx=n_ctx * n, n_threads=n_threads, n_parallel=n)
    return EngineRunner(c, model, mtp_model=mtp_model, n_ctx=n_ctx * n, n_threads=n_threads,
                        engine_kw={"n_parallel": n})


def _drive(runner: Runner, prompts: Sequence[Prompt], clients: int) -> tuple[float, list[Result]]:
    """All prompts through ``clients`` threads; the wall time and results in prompt order."""
    results, wall = run_clients(clients, [lambda p=p: runner.run(p.category, p.prompt, p.n_predict) for p in prompts])
    return wall, results


def run_parallel(prompts: Sequence[Prompt], configs: Sequence[BenchConfig], model: Path, n_clients: int, *,
                 mtp_model: str | None = None, n_ctx: int = 2048, n_threads: int | None = None,
                 repeat: int = 1, server: bool = False, progress: bool = True) -> list[ParallelRun]:
    runs: list[ParallelRun] = []
    for c in configs:
        pair = [ParallelRun(c.label, 1), ParallelRun(c.label, n_clients)]
        runners = [_runner(c, model, run.clients, mtp_model=mtp_model, n_ctx=n_ctx, n_threads=n_threads,
                           server=server) for run in pair]
        try:
            for r in runners:
                r.start()
                r.run("warmup", prompts[0].prompt, 8)
            for k in range(repeat):
                for run, r in zip(pair, runners):
                    wall, results = _drive(r, prompts, run.clients)
                    if progress:
                        print(f"bench: {c.label} {run.clients} client(s) pass {k + 1}: "
                              f"{sum(x.predicted for x in results) / wall:.1f} tok/s", file=sys.stderr)
                    if wall < run.wall_s:
                        run.wall_s, run.results = wall, results
        finally:
            for r in runners:
                r.close()
        runs += pair
    return runs


def same_texts(runs: Sequence[ParallelRun]) -> list[str]:
    """Configurations whose N-client texts differ from their 1-client texts."""
    bad = []
    for a, b in zip(runs[::2], runs[1::2]):
        if [r.text for r in a.results] != [r.text for r in b.results]:
            bad.append(a.config)
    return bad


def markdown(runs: Sequence[ParallelRun]) -> str:
    lines = ["| config | clients | requests | tokens | wall s | aggregate tok/s | x 1 client | accept |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for a, b in zip(runs[::2], runs[1::2]):
        for run in (a, b):
            lines.append(f"| {run.config} | {run.clients} | {len(run.results)} | {run.tokens} | {run.wall_s:.2f} | "
                         f"{run.tok_s:.1f} | {run.tok_s / a.tok_s if a.tok_s else 0:.2f} | {run.rate:.3f} |")
    return "\n".join(lines) + "\n"
