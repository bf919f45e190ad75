"""``python -m stepmtp``: generate with the chained MTP heads and report what they did.

With no model it runs the bundled model (``stepmtp.models``: a small Step3.5 model
trained on the CPython standard library, with three trained MTP heads), completing four
of the library's functions. ``--compare`` runs the same prompts without speculation,
with the single head and with the chain, checks that the texts agree at temperature 0,
and shows the target decodes each took and what a round costs against what it saves
(``stepmtp.compare``). ``--bench-model`` runs the model's bench-size variant, with
Step-3.5-Flash's cost shape, where the wall time shows what the chain saves.
"""
from __future__ import annotations

import argparse
import os
import sys
import textwrap
from pathlib import Path

from . import compare as C
from .engine import Engine
from .mtp import SpecConfig
from .stats import GenStats

#: the functions the default prompts ask for (their ``def`` line and docstring, from
#: ``stepmtp.models``' prompt sets; the last two are from modules the model never saw):
#: each completed to its end, a blank line, where the bundled model writes a plausible
#: body (further on, it repeats itself)
DEFAULT_FUNCTIONS = ("exists", "b64encode", "check", "encode")
#: where a default prompt's completion ends: the blank line after the function
DEFAULT_STOP = ("\n\n",)
#: a model smaller than this runs on one thread unless told otherwise: its decode is too
#: short to share (measured on the bundled model, 2 cores, a busy machine: two threads
#: made 250-400 tok/s, one 2600-2700)
SMALL_MODEL_BYTES = 64 << 20


def default_prompts() -> list[str]:
    from .models import EVAL_PROMPTS, OUT_OF_CORPUS_PROMPTS

    prompts = EVAL_PROMPTS + OUT_OF_CORPUS_PROMPTS
    return [next(p for p in prompts if p.startswith(f"def {name}(")) for name in DEFAULT_FUNCTIONS]


def _stats_line(label: str, st: GenStats) -> str:
    depth = " ".join(f"d{d + 1}={a}/{n}" for d, (a, n) in
                     enumerate(zip(st.accepted_per_depth, st.drafted_per_depth)))
    gen = st.t_gen_ms or 1.0
    return (f"{label:<14} pred={st.n_predicted:4d} draft={st.n_drafted:4d} acc={st.n_accepted:4d} "
            f"rate={st.accept_rate:.3f} tok/s={st.tokens_per_second:7.1f} [{depth}] "
            f"decodes tgt={st.n_target_decodes} dft={st.n_draft_decodes} "
            f"python={100 * st.t_python_ms / (st.t_prompt_ms + gen):.1f}%")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m stepmtp", description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", help="target GGUF (default: the bundled model)")
    ap.add_argument("--spec-draft-model", "-md", dest="mtp_model", help="MTP-only GGUF with the heads")
    ap.add_argument("-p", "--prompt", default=None,
                    help=f"the prompt (default: the bundled model's functions {', '.join(DEFAULT_FUNCTIONS)}, "
                         "each completed to its end)")
    ap.add_argument("-n", "--n-predict", type=int, default=None,
                    help="tokens per prompt (default: 64 for -p, at most 128 for the default prompts)")
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
    ap.add_argument("--spec-adaptive", action="store_true",
                    help="choose the draft length each round (the engine's and the server's default; off here, "
                         "so that the rounds are of one length)")
    ap.add_argument("--spec-batch-invariant", action="store_true",
                    help="each row of a verify computed as a one-row decode would (for GPU backends)")
    ap.add_argument("-c", "--ctx-size", type=int, default=4096)
    ap.add_argument("--swa-full", action="store_true", help="full-size sliding-window cache")
    ap.add_argument("-t", "--threads", type=int, default=None,
                    help="llama.cpp threads (default: all CPUs; 1 for a model under 64 MiB)")
    ap.add_argument("-ngl", "--n-gpu-layers", dest="ngl", default="auto",
                    help="layers to offload: a number, 'auto' (default: all with a GPU backend) or 'all'")
    ap.add_argument("--compare", action="store_true",
                    help="none vs single vs chain on the same prompts: the same text, the target decodes each "
                         "took, and what a round costs here and on Step-3.5-Flash")
    ap.add_argument("--repeat", type=int, default=3, help="--compare: runs of each prompt in each mode; the "
                    "fastest counts (default 3)")
    ap.add_argument("--bench-model", action="store_true",
                    help="run the model's bench-size variant: its predictions with Step-3.5-Flash's cost shape "
                         "(a ~3.3 GB file for the bundled model, made once in ~1 min into ~/.cache/stepmtp/bench), "
                         "whose decodes, bound by memory as Step-3.5-Flash's are, show in wall time what the "
                         "saved decodes are worth")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error(f"--repeat must be 1 or more, not {args.repeat}")
    if args.bench_model and args.mtp_model:
        ap.error("--bench-model shapes a model with its heads in the same file, not a split pair (-md)")
    bundled = args.model is None
    if bundled:
        from .models import default_model_path

        model = default_model_path()
    else:
        model = Path(args.model)
        if not model.is_file():
            ap.error(f"model not found: {model}")
    prompts = [args.prompt] if args.prompt is not None else default_prompts()
    n_predict = args.n_predict if args.n_predict is not None else (64 if args.prompt is not None else 128)
    if args.bench_model:
        from .bench.model import bench_model

        model = bench_model(model)
    size = model.stat().st_size
    if args.threads is None and size < SMALL_MODEL_BYTES and "STEPMTP_N_THREADS" not in os.environ:
        args.threads = 1

    def open_engine(mode: str, first: bool) -> Engine:
        spec = SpecConfig(mode=mode, n_max=args.spec_draft_n_max, n_min=args.spec_draft_n_min,
                          p_min=args.spec_draft_p_min, schedule=args.spec_schedule,
                          verify=args.spec_verify, adaptive=args.spec_adaptive)
        eng = Engine(model, mtp_model=args.mtp_model, spec=spec, n_ctx=args.ctx_size,
                     n_threads=args.threads, seed=args.seed, swa_full=args.swa_full, n_gpu_layers=args.ngl,
                     batch_invariant=args.spec_batch_invariant, progress=first and sys.stderr.isatty())
        if first:
            n_heads = (eng.draft_model or eng.model).n_mtp_blocks_loaded
            # beside the report; apart from the text alone
            print(C.model_line(model, eng.model, n_heads, bundled, args.bench_model),
                  file=sys.stdout if args.compare else sys.stderr)
        return eng

    modes = ["none", "single", "chain"] if args.compare else [args.mtp_mode]
    gen = dict(n_predict=n_predict, temperature=args.temp, stop=DEFAULT_STOP if args.prompt is None else (),
               cache_prompt=False)
    runs = C.run_modes(open_engine, modes, args.spec_draft_n_max, prompts, gen,
                       repeat=args.repeat if args.compare else 1,
                       reload=size <= C.RELOAD_MAX_BYTES, adaptive=args.spec_adaptive)
    if not args.compare:
        print("\n\n".join(p + text for p, text in zip(prompts, runs[args.mtp_mode].texts)))
        print(_stats_line(args.mtp_mode, runs[args.mtp_mode].stats), file=sys.stderr)
        return 0
    return _report(args, model, prompts, runs)


def _say(text: str) -> None:
    """A paragraph of the report, wrapped for a terminal."""
    print(textwrap.fill(text, width=100, break_on_hyphens=False))


def _report(args: argparse.Namespace, model: Path, prompts: list[str], runs: dict[str, C.ModeRun]) -> int:
    what = (f"{len(prompts)} functions of Python's standard library, each completed to its end"
            if args.prompt is None else "The prompt")
    how = "greedy" if args.temp <= 0 else f"at temperature {args.temp}"
    _say(f"{what}, {how}, in three modes. Each round the heads draft tokens and the target checks them all in "
         f"one decode, keeping those it would have picked: none drafts nothing, single drafts "
         f"{'up to ' if args.spec_adaptive else ''}{args.spec_draft_n_max} tokens with the first head (the "
         "behaviour before chaining), chain drafts token i with head i.")
    print()
    for line in C.decodes_table(list(runs.values())):
        print("  " + line)
    status = _check_texts(args, runs)
    chain, none = runs["chain"], runs["none"]
    print("\nThe chain's text:\n")
    for p, text in zip(prompts, chain.texts):
        print(p + text + "\n")
    if chain.rounds and none.rounds:
        _say(f"The chain made the same text with {none.target_decodes / chain.target_decodes:.1f}x fewer target "
             f"decodes: each round the heads drafted {chain.verify_rows - 1:.1f} tokens, the target verified them "
             f"in one decode and kept {chain.stats.n_accepted / chain.stats.n_rounds:.1f}, plus its own next "
             "token.")
    runs_note = f"the fastest of {args.repeat} runs" if args.repeat > 1 else "one run"
    print(f"\nWhere the time went ({runs_note}):\n")
    for line in C.time_table(list(runs.values())):
        print("  " + line)
    kv = ", ".join(f"{m} {r.kv_mib[0]:.2f}" + (f" + heads {r.kv_mib[1]:.2f}" if r.kv_mib[1] else "")
                   for m, r in runs.items())
    print(f"  KV cache, MiB: {kv}\n")
    for i, paragraph in enumerate(_costs(args, model, chain, none)):
        if paragraph.startswith(" "):  # a command stays one line, to copy
            print(paragraph)
            continue
        if i:
            print()
        _say(paragraph)
    return status


def _check_texts(args: argparse.Namespace, runs: dict[str, C.ModeRun]) -> int:
    if args.temp > 0:
        print("(above temperature 0 the modes sample differently: their texts may differ)")
        return 0
    if C.same_tokens(runs):
        print("ok: the three modes made the same text, token for token")
        return 0
    from . import system_info

    if system_info().get("gpus") and not args.spec_batch_invariant:
        # a GPU's kernels round a row differently with the rows a decode carries, so a
        # verify and a one-row decode may pick different near-ties
        print("the texts differ: on a GPU backend a verify's rows round differently from one-row decodes "
              "(--spec-batch-invariant makes them agree)")
        return 0
    print("MISMATCH: the modes produced different text at temperature 0", file=sys.stderr)
    return 1


def _costs(args: argparse.Namespace, model: Path, chain: C.ModeRun, none: C.ModeRun) -> list[str]:
    """Why the time is what it is: a plain decode's time here, a verify's and a head's
    cost against it; the same on Step-3.5-Flash, with the speed the chain's rounds would
    have there."""
    from .bench.flash import estimate_costs, measure_costs

    flash, _ = estimate_costs()
    rows = round(chain.verify_rows)
    verify_there = C.verify_cost(flash, rows, "verify{}/target1")
    flash_round, flash_speed = C.flash_speed(chain, flash)
    decode_ms = none.stats.t_gen_ms / none.rounds if none.rounds else 0.0
    what = "the bench-size model" if args.bench_model else f"this {model.stat().st_size / 2**20:.0f} MB model"
    here = f"On {what} a plain decode takes {decode_ms:.2f} ms"
    verify_here = None
    if args.mtp_model is None:  # the heads in the model's own file: their decodes timed alone
        alone = measure_costs(model, n=12 if model.stat().st_size > 2**30 else 40, n_threads=args.threads)
        verify_here = C.verify_cost(alone, rows, "target{}/target1")
        here += (f"; against it a verify of {rows} rows costs {verify_here:.2f}, a head decode "
                 f"{C.head_cost(alone):.2f} (each measured alone)")
    out = [
        f"{here}, and Python {chain.python_ms_per_round:.2f} ms a round. On Step-3.5-Flash (memory-bound, from its "
        f"published configuration) a verify of {rows} rows costs {verify_there:.2f} decodes and a head decode "
        f"{flash['head/target1']:.2f}: a round of the chain's {chain.tokens_per_round:.2f} tokens would cost "
        f"{flash_round:.2f} decodes there, {flash_speed:.2f}x plain decoding's speed, if its heads accept as these did.",
    ]
    speed = chain.stats.tokens_per_second / none.stats.tokens_per_second if none.stats.tokens_per_second else 0.0
    if not args.bench_model:
        from .bench.model import cache_dir

        why = ("This model is too small to show that in wall time: its decode is so cheap that what a round adds "
               "weighs as much as the decodes it saves. " if speed < 1 else "")
        out.append(f"{why}To time the same text on a model with Step-3.5-Flash's cost shape (its bench-size "
                   f"variant: a ~3.3 GB file made once, in ~1 min, into {cache_dir() / 'bench'}):")
        out.append("    python -m stepmtp --compare --bench-model")
    elif verify_here is not None and verify_here > 1.1 * verify_there:
        out.append(f"Here a verify costs more than on Step-3.5-Flash ({verify_here:.2f} decodes against "
                   f"{verify_there:.2f}): on a CPU a verify's extra rows cost compute besides the weights' reading, "
                   "the more so on few or busy cores, where a GPU reads the weights once for all the rows. With "
                   "free cores and a thread on each (-t), a decode is bound by memory and a verify comes nearer "
                   "the estimate.")
    return out


if __name__ == "__main__":
    sys.exit(main())
