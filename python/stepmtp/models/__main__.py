"""``python -m stepmtp.models``: where the default model is, its split pair, its acceptance.

    python -m stepmtp.models                 # path of the bundled model
    python -m stepmtp.models --split DIR     # write its trunk + MTP-only GGUFs into DIR
    python -m stepmtp.models --bench         # greedy acceptance on both prompt sets:
                                             # held-in (EVAL_PROMPTS) and out-of-corpus
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import EVAL_PROMPTS, OUT_OF_CORPUS_PROMPTS, default_model_path, measure_acceptance, split_model

#: The bench's prompt sets: functions of the training corpus, and of standard-library
#: modules the model was not trained on (OUT_OF_CORPUS_FILES).
PROMPT_SETS = {"held-in": EVAL_PROMPTS, "out-of-corpus": OUT_OF_CORPUS_PROMPTS}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m stepmtp.models", description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", type=Path, help="another step35 GGUF (default: the bundled one)")
    ap.add_argument("--split", type=Path, metavar="DIR", help="write the trunk + MTP-only GGUFs into DIR")
    ap.add_argument("--bench", action="store_true", help="acceptance per mode and depth on the prompt sets")
    ap.add_argument("--prompts", choices=[*PROMPT_SETS, "both"], default="both",
                    help="--bench: which prompt set (default both)")
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
        sets = PROMPT_SETS if args.prompts == "both" else {args.prompts: PROMPT_SETS[args.prompts]}
        results = {name: measure_acceptance(model, prompts, n_predict=args.n_predict, n_threads=args.threads)
                   for name, prompts in sets.items()}
        if args.json:
            print(json.dumps({name: {f"{m} n_max={n}": {k: v for k, v in r.items() if k != "texts"}
                                     for (m, n), r in res.items()} for name, res in results.items()}, indent=1))
        else:
            for name, res in results.items():
                print(f"{name}: {len(sets[name])} prompts x {args.n_predict} tokens, temperature 0")
                print(f"{'mode':8s} {'n-max':>5s} {'drafted':>8s} {'accepted':>8s} {'rate':>6s}  "
                      "per depth (accepted/drafted)")
                for (mode, n_max), r in res.items():
                    depth = "  ".join(f"d{d + 1} {a}/{n} ({a / n if n else 0:.3f})" for d, (a, n) in
                                      enumerate(zip(r["accepted_per_depth"], r["drafted_per_depth"])) if n)
                    print(f"{mode:8s} {n_max:5d} {r['drafted']:8d} {r['accepted']:8d} {r['rate']:6.3f}  {depth}")
        if args.show:
            for name, res in results.items():
                for p, t in zip(sets[name], res[("chain", 3)]["texts"]):
                    print("-" * 60)
                    print(p + t)
    return 0


if __name__ == "__main__":
    sys.exit(main())
