"""``python -m stepmtp.models``: where the default model is, its split pair, its acceptance.

    python -m stepmtp.models                 # path of the bundled model
    python -m stepmtp.models --split DIR     # write its trunk + MTP-only GGUFs into DIR
    python -m stepmtp.models --bench         # greedy acceptance on the held-in prompts
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import EVAL_PROMPTS, default_model_path, measure_acceptance, split_model


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m stepmtp.models", description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", type=Path, help="another step35 GGUF (default: the bundled one)")
    ap.add_argument("--split", type=Path, metavar="DIR", help="write the trunk + MTP-only GGUFs into DIR")
    ap.add_argument("--bench", action="store_true", help="acceptance per mode and depth on the held-in prompts")
    ap.add_argument("-n", "--n-predict", type=int, default=160)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--json", action="store_true", help="print the bench result as JSON")
    ap.add_argument("--show", action="store_true", help="print the chain n-max 3 completions")
    args = ap.parse_args(argv)

    model = args.model or default_model_path()
    print(model)
    if args.split:
        for variant, path in split_model(model, args.split).items():
            print(f"{variant:6s} {path} ({path.stat().st_size} bytes)")
    if args.bench:
        res = measure_acceptance(model, EVAL_PROMPTS, n_predict=args.n_predict, n_threads=args.threads)
        if args.json:
            print(json.dumps({f"{m} n_max={n}": {k: v for k, v in r.items() if k != "texts"}
                              for (m, n), r in res.items()}, indent=1))
        else:
            print(f"{len(EVAL_PROMPTS)} prompts x {args.n_predict} tokens, temperature 0")
            print(f"{'mode':8s} {'n-max':>5s} {'drafted':>8s} {'accepted':>8s} {'rate':>6s}  per depth (accepted/drafted)")
            for (mode, n_max), r in res.items():
                depth = "  ".join(f"d{d + 1} {a}/{n} ({a / n if n else 0:.3f})" for d, (a, n) in
                                  enumerate(zip(r["accepted_per_depth"], r["drafted_per_depth"])) if n)
                print(f"{mode:8s} {n_max:5d} {r['drafted']:8d} {r['accepted']:8d} {r['rate']:6.3f}  {depth}")
        if args.show:
            key = ("chain", 3)
            for p, t in zip(EVAL_PROMPTS, res[key]["texts"]):
                print("-" * 60)
                print(p + t)
    return 0


if __name__ == "__main__":
    sys.exit(main())
