"""What stop strings and repetition penalties cost per token, and how that depends
on the output's or the history's length (it should not).

    python bench/per_token_costs.py

Prints the median cost of one token's stop check with 100 stop strings (each 100
characters) after 100 and after 100,000 characters of output, and of one greedy row
with repetition penalties over the whole history (repeat_last_n -1, a 128k
vocabulary, as Step-3.5-Flash's) at 1k and at 100k tokens of history, with 3 draft
tokens after it. Nothing is asserted: the tests check the work per token is bounded.
"""
from __future__ import annotations

import statistics
import time

import numpy as np

from stepmtp.sampling import Sampler, SamplingParams
from stepmtp.slots import TextAssembler


def stop_cost(n_before: int, reps: int = 2000) -> float:
    asm = TextAssembler([f"<stop-{i:03d}-{'x' * 88}>" for i in range(100)])
    for _ in range(n_before // 5):
        asm.push(b"word ")
        asm.take()
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        asm.push(b"<stop-0" if i % 2 else b"word ")
        asm.take()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def penalty_cost(n_hist: int, n_vocab: int = 128_000, reps: int = 50) -> float:
    rng = np.random.default_rng(0)
    s = Sampler(SamplingParams(temperature=0, repeat_penalty=1.1, presence_penalty=0.1, repeat_last_n=-1))
    logits = rng.normal(size=n_vocab).astype(np.float32)
    hist = rng.integers(0, n_vocab, size=n_hist).tolist()
    s.sample(logits, hist)
    times = []
    for _ in range(reps):
        hist.append(int(rng.integers(0, n_vocab)))
        t0 = time.perf_counter()
        s.sample(logits, hist, [1, 2, 3])
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    print("100 stop strings of 100 characters, per token:")
    for n in (100, 100_000):
        print(f"  after {n:>7,} characters of output: {1e6 * stop_cost(n):7.1f} us")
    print("repetition penalties over the whole history (128k vocabulary), per sampled row:")
    for n in (1_000, 100_000):
        print(f"  at {n:>7,} tokens of history: {1e3 * penalty_cost(n):7.3f} ms")


if __name__ == "__main__":
    main()
