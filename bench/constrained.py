"""Speculation under a JSON schema: acceptance and tok/s, constrained against
unconstrained, and grammar-aware drafting (the heads' rows masked too) against plain
drafts, on the bundled model, interleaved prompt by prompt.

    python bench/constrained.py [--repeat 3] [-t 1]

Each prompt of the bench's default set is followed by ``return `` and decoded greedily
under a schema of a small record (bounded strings, an integer, a list); the texts of
the constrained configurations must agree (exit 3 otherwise).
"""
from __future__ import annotations

import argparse
import sys
import time

from stepmtp import Engine
from stepmtp.bench.prompts import load_prompts
from stepmtp.grammar import Constraint
from stepmtp.models import default_model_path

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "size": {"type": "integer", "minimum": 0, "maximum": 100000},
                                           "items": {"type": "array", "maxItems": 4,
                                                     "items": {"type": "string", "maxLength": 16}}},
          "required": ["name", "size", "items"], "additionalProperties": False}
CONFIGS = {  # label: (engine mode, constrained, mask_drafts)
    "none, schema": ("none", True, True),
    "chain-3, schema, masked drafts": ("chain", True, True),
    "chain-3, schema, plain drafts": ("chain", True, False),
    "chain-3, no schema": ("chain", False, True),
    "none, no schema": ("none", False, True),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("-n", type=int, default=160)
    args = ap.parse_args()
    path = default_model_path()
    prompts = [p.prompt + "\n    return " for p in load_prompts(None).prompts]
    engines = {m: Engine(path, mode=m, n_max=3, n_ctx=2048, n_threads=args.threads) for m in ("none", "chain")}
    grammar = Constraint.compile(engines["none"].model, "json_schema", SCHEMA)
    tot = {k: {"drafted": 0, "accepted": 0, "tokens": 0, "ms": 0.0} for k in CONFIGS}
    texts: dict[str, list[str]] = {k: [] for k in CONFIGS}
    try:
        for p in prompts:
            best: dict[str, float] = {}
            for _ in range(args.repeat):
                for label, (mode, constrained, masked) in CONFIGS.items():
                    t0 = time.perf_counter()
                    out = engines[mode].generate(p, n_predict=args.n, temperature=0, cache_prompt=False,
                                                 grammar=grammar if constrained else None, mask_drafts=masked)
                    dt = (time.perf_counter() - t0) * 1e3
                    if label not in best or dt < best[label]:
                        best[label] = dt
                        last = out
                    if label not in texts or len(texts[label]) < prompts.index(p) + 1:
                        texts[label].append(out.text)
                        st = out.stats
                        tot[label]["drafted"] += st.n_drafted
                        tot[label]["accepted"] += st.n_accepted
                        tot[label]["tokens"] += len(out.tokens)
            for label in CONFIGS:
                tot[label]["ms"] += best[label]
    finally:
        for e in engines.values():
            e.close()
    print(f"bundled model, {len(prompts)} prompts, up to {args.n} tokens, greedy, best of {args.repeat}, "
          f"{args.threads} thread(s)")
    print("| configuration | accepted / drafted | tokens | tok/s |")
    print("|---|---|---|---|")
    for label, t in tot.items():
        rate = f"{t['accepted']}/{t['drafted']} = {t['accepted'] / t['drafted']:.3f}" if t["drafted"] else "-"
        print(f"| {label} | {rate} | {t['tokens']} | {1e3 * t['tokens'] / t['ms']:.0f} |")
    constrained = [k for k, c in CONFIGS.items() if c[1]]
    if any(texts[k] != texts[constrained[0]] for k in constrained):
        print("the constrained configurations' texts differ", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
