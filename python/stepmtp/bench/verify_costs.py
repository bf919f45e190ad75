"""``--verify-costs``: what a verify of k rows costs, in one-row decodes, with our
kernels and with llama.cpp's own.

A speculative round pays one target decode of 1 + n rows; whether drafting pays on a
CPU turns on what those rows cost against one row. For each k this decodes k rows of
one sequence after a prompt (every row an output, as a verify asks), takes them back,
and repeats; the figure is the median time over the median one-row decode's of the
same process. It runs twice, each time in a fresh process: with our per-row rule
(patches 0010, 0016 and 0019: a decode's rows keep a one-row decode's bits) and with
it off (``GGML_CPU_ROW_INVARIANT_ROWS=0``: llama.cpp's gemm and tiled products, whose
rows depend on the batch). The ratio of the two is what exactness costs at each k.

    python -m stepmtp.bench --verify-costs --bench-model [--bench-weights Q4_K_M] -t 2
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

__all__ = ["ROWS", "measure", "run_verify_costs", "verify_costs_markdown"]

ROWS = (1, 2, 3, 4, 8, 16, 32, 63)
#: the settings compared, by name: the environment each process runs with
RULES = {"ours": {}, "llama.cpp": {"GGML_CPU_ROW_INVARIANT_ROWS": "0"}}


def measure(model: str | os.PathLike[str], *, rows: Sequence[int] = ROWS, prompt: int = 200, reps: int = 9,
            threads: int | None = None) -> dict[int, float]:
    """Median seconds of a decode of k rows of one sequence after ``prompt`` tokens, by k."""
    import numpy as np

    from ..llama import Batch, Context, Model

    with Model(model) as m:
        n_vocab = m.n_vocab
        ctx = Context(m, n_ctx=prompt + max(rows) + 64, n_batch=max(512, max(rows)), n_ubatch=512,
                      n_threads=threads, n_threads_batch=threads)
        rng = np.random.default_rng(0)
        toks = [int(t) for t in rng.integers(10, min(n_vocab, 4000), size=prompt + max(rows))]
        b = Batch(max(512, max(rows)))
        for i in range(0, prompt, 512):  # the prompt, in chunks of a batch
            b.clear()
            for j in range(i, min(prompt, i + 512)):
                b.add(toks[j], j, 0, j == prompt - 1)
            ctx.decode(b)
        out: dict[int, float] = {}
        for k in [rows[0], *rows]:  # the first k twice: its first decodes warm the caches
            times = []
            for _ in range(reps):
                b.clear()
                for j in range(k):
                    b.add(toks[prompt + j], prompt + j, 0, True)
                t0 = time.perf_counter()
                ctx.decode(b)
                times.append(time.perf_counter() - t0)
                ctx.seq_rm(0, prompt, -1)
            out[k] = statistics.median(times)
        ctx.close()
    return out


def run_verify_costs(model: Path, *, threads: int | None = None, reps: int = 9, prompt: int = 200,
                     rows: Sequence[int] = ROWS, passes: int = 2, progress: bool = True) -> dict[str, Any]:
    """Each rule in ``passes`` fresh processes each, alternating; per rule and k the
    median of the passes' ratios to their own one-row decode."""
    ratios: dict[str, dict[int, list[float]]] = {name: {k: [] for k in rows} for name in RULES}
    one_row: dict[str, list[float]] = {name: [] for name in RULES}
    for p in range(passes):
        for name, env in RULES.items():
            code = ("import json,sys; from stepmtp.bench.verify_costs import measure; "
                    f"print(json.dumps(measure({str(model)!r}, rows={list(rows)!r}, prompt={prompt}, reps={reps}, "
                    f"threads={threads!r})))")
            proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True,
                                  text=True, timeout=3600)
            if proc.returncode != 0:
                raise RuntimeError(f"verify costs ({name}): {proc.stderr.strip()[-2000:]}")
            t = {int(k): v for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}
            one_row[name].append(t[1])
            for k in rows:
                ratios[name][k].append(t[k] / t[1])
            if progress:
                print(f"verify costs: pass {p + 1}/{passes} {name}: " +
                      ", ".join(f"k={k} {t[k] / t[1]:.2f}" for k in rows), file=sys.stderr)
    return {"rows": list(rows), "prompt": prompt,
            "one_row_ms": {n: 1e3 * statistics.median(v) for n, v in one_row.items()},
            "ratios": {n: {k: statistics.median(v) for k, v in r.items()} for n, r in ratios.items()}}


def verify_costs_markdown(doc: dict[str, Any]) -> str:
    rows = doc["rows"]
    r = doc["ratios"]
    lines = [f"a decode of k rows of one sequence after {doc['prompt']} tokens, in one-row decodes "
             f"(one row: ours {doc['one_row_ms']['ours']:.2f} ms, llama.cpp's kernels "
             f"{doc['one_row_ms']['llama.cpp']:.2f} ms)\n",
             "| kernels | " + " | ".join(f"k = {k}" for k in rows) + " |", "|---|" + "---:|" * len(rows)]
    for name in RULES:
        lines.append(f"| {name} | " + " | ".join(f"{r[name][k]:.2f}" for k in rows) + " |")
    # in absolute terms: our k rows' time over llama.cpp's, each against its own one row
    ms = doc["one_row_ms"]
    lines.append("| ours x llama.cpp's | " + " | ".join(
        f"{r['ours'][k] * ms['ours'] / (r['llama.cpp'][k] * ms['llama.cpp']):.2f}" for k in rows) + " |")
    return "\n".join(lines) + "\n"
