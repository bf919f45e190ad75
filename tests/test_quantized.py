"""Quantized weights: MTP keeps plain decoding's text at temperature 0, alone and beside
other sequences, on the weight types users run.

The model is the tiny Step3.5 model widened to 256 (a K-quant block), so that
llama.cpp's quantizer writes real K-quant matrices, and quantized by llama.cpp itself
(``stepmtp.llama.quantize``). Four sequences with three drafts each make 16-row
verifies, past the 8 rows from which llama.cpp's tiled K-quant product takes over a
product: every row must still be summed as a one-row decode sums it.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from stepmtp import Engine
from stepmtp.llama import ModelLoadError, quantize
from stepmtp.tiny import CONFIG, write_tiny_models

WIDE = replace(CONFIG, n_embd=256, head_dim=64, n_ff=512, n_ff_exp=256, n_ff_shexp=256)
PROMPTS = ["import os\nimport sys\n\n\ndef main(argv):\n", "class Reader:\n    def __init__(self, path):\n",
           "def fib(n):\n    if n < 2:\n", "for line in open(path):\n    "]
N = 48
#: a type each file must hold, so the type's kernels are the ones run
HOLDS = {"F16": "F16", "Q8_0": "Q8_0", "Q4_0": "Q4_0", "Q4_K_M": "Q4_K", "IQ4_XS": "IQ4_XS", "Q6_K": "Q6_K"}


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> Path:
    return write_tiny_models(tmp_path_factory.mktemp("wide"), seed=3, cfg=WIDE)["embedded"]


@pytest.fixture(scope="module", params=list(HOLDS))
def quantized(request, wide, tmp_path_factory) -> tuple[str, Path]:
    dst = tmp_path_factory.mktemp("quant") / f"wide-{request.param}.gguf"
    return request.param, quantize(wide, dst, request.param)


def _types(path: Path) -> set[str]:
    import gguf

    return {t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}


def test_quantize_writes_the_type_and_refuses_what_it_cannot(quantized, tmp_path):
    qtype, path = quantized
    assert HOLDS[qtype] in _types(path)
    with pytest.raises(ValueError, match="unknown type"):
        quantize(path, tmp_path / "x.gguf", "Q3_Z")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a model")
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        quantize(bad, tmp_path / "y.gguf", "Q8_0")


def test_mtp_writes_plain_text_alone_and_beside_others(quantized):
    qtype, path = quantized
    with Engine(path, mode="none", n_ctx=1024) as eng:
        plain = [eng.generate(p, n_predict=N, temperature=0).tokens for p in PROMPTS]
    assert all(len(set(t)) > 3 for t in plain), "the wide model should not repeat one token"
    # one sequence, then four together (16-row verifies), a fixed length of three drafts
    with Engine(path, mode="chain", n_max=3, adaptive=False, n_ctx=1024) as eng:
        alone = eng.generate(PROMPTS[0], n_predict=N, temperature=0)
        assert alone.stats.n_drafted > 0
        assert alone.tokens == plain[0], f"{qtype}: MTP alone parted from plain decoding"
    with Engine(path, mode="chain", n_max=3, adaptive=False, n_ctx=2048, n_parallel=4) as eng:
        together = eng.generate_many(PROMPTS, n_predict=N, temperature=0)
    for i, out in enumerate(together):
        assert out.tokens == plain[i], f"{qtype}: prompt {i} parted from plain decoding beside three others"
