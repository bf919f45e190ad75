"""``python -m stepmtp``: generate with the chained MTP heads and report what they did.

With no model it runs the bundled model (``stepmtp.models``: a small Step3.5 model
trained on the CPython standard library, with three trained MTP heads).
``--compare`` runs the same prompt without speculation, with the single head and
with the chain, checks that the outputs agree at temperature 0, and prints a table.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .engine import Engine
from .mtp import SpecConfig
from .stats import GenStats

#: a function the bundled model has seen: its signature and docstring, so it goes on
#: with the body (the heads predict best on text like their training text)
DEFAULT_PROMPT = 'def heappush(heap, item):\n    """Push item onto heap, maintaining the heap invariant."""'


def _default_model() -> Path:
    from .models import default_model_path

    return default_model_path()


def _stats_line(label: str, st: GenStats) -> str:
    depth = " ".join(f"d{d + 1}={a}/{n}" for d, (a, n) in
                     enumerate(zip(st.accepted_per_depth, st.drafted_per_depth)))
    gen = st.t_gen_ms or 1.0
    return (f"{label:<14} pred={st.n_predicted:4d} draft={st.n_drafted:4d} acc={st.n_accepted:4d} "
            f"rate={st.accept_rate:.3f} tok/s={st.tokens_per_second:7.1f} [{depth}] "
            f"decodes tgt={st.n_target_decodes} dft={st.n_draft_decodes} "
            f"python={100 * st.t_python_ms / (st.t_prompt_ms + gen):.1f}%")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m stepmtp", description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", help="target GGUF (default: the bundled model)")
    ap.add_argument("--spec-draft-model", "-md", dest="mtp_model", help="MTP-only GGUF with the heads")
    ap.add_argument("-p", "--prompt", default=DEFAULT_PROMPT)
    ap.add_argument("-n", "--n-predict", type=int, default=64)
    ap.add_argument("--temp", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=-1)
    ap.add_argument("--mtp-mode", choices=["chain", "single", "none"], default="chain")
    ap.add_argument("--spec-draft-n-max", type=int, default=3)
    ap.add_argument("--spec-draft-n-min", type=int, default=0)
    ap.add_argument("--spec-draft-p-min", type=float, default=0.0)
    ap.add_argument("--spec-schedule", choices=["fused", "reference"], default="fused",
                    help="fused: process inside the next draft decodes; reference: the change's schedule")
    ap.add_argument("--spec-verify", choices=["auto", "exact", "rejection"], default="auto",
                    help="verification at temperature > 0 (auto: rejection sampling)")
    ap.add_argument("--spec-adaptive", action="store_true", help="choose the draft length each round")
    ap.add_argument("--spec-batch-invariant", action="store_true",
                    help="each row of a verify computed as a one-row decode would (for GPU backends)")
    ap.add_argument("-c", "--ctx-size", type=int, default=4096)
    ap.add_argument("--swa-full", action="store_true", help="full-size sliding-window cache")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("-ngl", "--n-gpu-layers", dest="ngl", default="auto",
                    help="layers to offload: a number, 'auto' (default: all with a GPU backend) or 'all'")
    ap.add_argument("--compare", action="store_true", help="none vs single vs chain on the same prompt")
    args = ap.parse_args(argv)

    model = Path(args.model) if args.model else _default_model()
    modes = ["none", "single", "chain"] if args.compare else [args.mtp_mode]
    texts = {}
    for mode in modes:
        spec = SpecConfig(mode=mode, n_max=args.spec_draft_n_max, n_min=args.spec_draft_n_min,
                          p_min=args.spec_draft_p_min, schedule=args.spec_schedule,
                          verify=args.spec_verify, adaptive=args.spec_adaptive)
        with Engine(model, mtp_model=args.mtp_model, spec=spec, n_ctx=args.ctx_size,
                    n_threads=args.threads, seed=args.seed, swa_full=args.swa_full, n_gpu_layers=args.ngl,
                    batch_invariant=args.spec_batch_invariant, progress=sys.stderr.isatty()) as eng:
            if mode == modes[0]:
                print(f"model: {model} ({eng.model.description}), MTP heads: {eng.model.n_mtp_blocks_loaded}",
                      file=sys.stderr)
            out = eng.generate(args.prompt, n_predict=args.n_predict, temperature=args.temp)
            mem = eng.memory()
        texts[mode] = out.text
        if not args.compare:
            print(args.prompt + out.text)
        print(_stats_line(mode, out.stats) + f" KV MiB tgt={mem['target']['kv'] / 2**20:.2f} "
              f"dft={mem['draft']['kv'] / 2**20:.2f}", file=sys.stderr)
    if args.compare:
        print(args.prompt + texts["chain"])
        if args.temp <= 0 and len(set(texts.values())) != 1:
            print("MISMATCH: the modes produced different text at temperature 0", file=sys.stderr)
            return 1
        if args.temp <= 0:
            print("ok: none, single and chain produced identical text", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
