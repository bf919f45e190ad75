"""A/B of the adaptive draft length with and without its per-draft probability cut,
beside plain decoding and the fixed lengths, in one process, interleaved prompt by
prompt (machine drift hits all alike).

    python tools/adaptive_ab.py [MODEL|flash] [N_PREDICT] [REPEAT]

MODEL ``flash`` (the default) is the bench-size model (``--bench-model``), made on first
use. Every prompt of the bench's set is processed again each time (no prompt cache), and
each configuration keeps its best time per prompt. The README's "second machine" table
is what this printed there (flash 192 2).
"""
from __future__ import annotations

import sys
import time

from stepmtp import Engine
from stepmtp.bench.model import BENCH_MODEL_MB, bench_model, resolve_model
from stepmtp.bench.prompts import load_prompts

CONFIGS = {
    "none": dict(mode="none"),
    "chain-1": dict(n_max=1),
    "chain-2": dict(n_max=2),
    "chain-3": dict(n_max=3),
    "adapt-no-cut": dict(n_max=3, adaptive=True),
    "adapt-cut": dict(n_max=3, adaptive=True),
}


def main(argv: list[str]) -> int:
    spec = argv[0] if argv else "flash"
    n_pred = int(argv[1]) if len(argv) > 1 else 192
    reps = int(argv[2]) if len(argv) > 2 else 2
    model = bench_model(resolve_model(None), BENCH_MODEL_MB, quiet=True) if spec == "flash" else spec
    prompts = [p.prompt for p in load_prompts(None).select(None, None, n_pred).prompts]
    engines = {k: Engine(model, n_ctx=2048, n_threads=1, **kw) for k, kw in CONFIGS.items()}
    engines["adapt-no-cut"].driver._costs.cut_by_probability = False
    best = {k: [float("inf")] * len(prompts) for k in engines}
    texts: dict[int, set[str]] = {}
    lengths: dict[str, list[list[int]]] = {}
    try:
        for r in range(reps):
            for i, p in enumerate(prompts):
                for k, eng in engines.items():
                    t0 = time.perf_counter()
                    out = eng.generate(p, n_predict=n_pred, temperature=0, cache_prompt=False)
                    best[k][i] = min(best[k][i], time.perf_counter() - t0)
                    texts.setdefault(i, set()).add(out.text)
                    if r == reps - 1 and k.startswith("adapt"):
                        lengths.setdefault(k, []).append(list(out.stats.rounds_by_length))
            print(f"repeat {r + 1}/{reps} done", file=sys.stderr, flush=True)
        tot = {k: sum(v) for k, v in best.items()}
        fixed = min(tot[k] for k in ("chain-1", "chain-2", "chain-3"))
        for k, v in tot.items():
            print(f"{k:13s} {v:7.2f} s  x plain {tot['none'] / v:.3f}  x best drafting length {fixed / v:.3f}")
        for k, ls in lengths.items():
            print(f"{k}: rounds by length, per prompt: {ls}")
        same = all(len(s) == 1 for s in texts.values())
        print("texts identical:", same)
        return 0 if same else 3
    finally:
        for eng in engines.values():
            eng.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
