"""A/B of the adaptive draft length with and without its per-draft probability cut,
beside plain decoding and the fixed lengths (the bench's ``--compare adaptive`` plus the
policy without the cut), run by the bench's harness: in-process, interleaved prompt by
prompt, best of the repeats, texts checked.

    python tools/adaptive_ab.py [MODEL|flash] [N_PREDICT] [REPEAT]

MODEL ``flash`` (the default) is the bench-size model (``--bench-model``), made on first
use. Exits 3 when the texts differ.
"""
from __future__ import annotations

import sys
from dataclasses import asdict

from stepmtp.bench import report as R
from stepmtp.bench.harness import run_bench
from stepmtp.bench.model import BENCH_MODEL_MB, bench_model, resolve_model
from stepmtp.bench.prompts import load_prompts
from stepmtp.bench.runners import COMPARE_ADAPTIVE_CONFIGS, BenchConfig, EngineRunner, parse_configs


class NoCutConfig(BenchConfig):
    """The adaptive length with every draft of the chosen length kept."""

    @property
    def label(self) -> str:
        return super().label + "-nocut"


class NoCutRunner(EngineRunner):
    def start(self) -> None:
        super().start()
        self.engine.driver._costs.cut_by_probability = False


def main(argv: list[str]) -> int:
    spec = argv[0] if argv else "flash"
    n_pred = int(argv[1]) if len(argv) > 1 else 192
    reps = int(argv[2]) if len(argv) > 2 else 2
    model = bench_model(resolve_model(None), BENCH_MODEL_MB, quiet=True) if spec == "flash" else spec
    prompts = load_prompts(None).select(None, None, n_pred)
    cfgs = parse_configs(COMPARE_ADAPTIVE_CONFIGS)
    runners = [EngineRunner(c, model, n_threads=1) for c in cfgs]
    runners.append(NoCutRunner(NoCutConfig(**asdict(cfgs[-1])), model, n_threads=1))
    run = run_bench(prompts, runners, repeat=reps, settings={"threads": 1})
    print(R.markdown(run))
    return 3 if run.mismatches else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
