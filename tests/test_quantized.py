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


Q4K_ROWS = r"""
    import hashlib, json, sys
    import numpy as np
    from stepmtp import Batch, Context, Model

    m = Model(sys.argv[1])
    toks = (m.tokenize("import os\nimport sys\n\ndef main(argv):\n", add_special=False) * 12)[:96]
    start, n = 40, 40
    out = {}
    with Context(m, n_ctx=256, n_threads=2, n_threads_batch=2) as ctx:
        b = Batch(64)
        rows = {}
        for k in (1, 3, 4, 8, 16, 40):  # a decode, verifies, a prompt chunk: experts of 4+ rows
            ctx.seq_rm(0, 0, -1)
            b.fill(toks[:start], 0, outputs="none")
            ctx.decode(b)
            got = []
            for s in range(start, start + n, k):
                b.fill(toks[s : min(s + k, start + n)], s, outputs="all")
                ctx.decode(b)
                got.append(ctx.logits_rows(b.n).copy())
            rows[k] = np.concatenate(got)
        one = rows[1]
        out["finite"] = bool(np.isfinite(one).all() and one.std() > 0)
        out["lone"] = {str(k): bool(np.array_equal(rows[k], one)) for k in rows}
        out["sha"] = {str(k): hashlib.sha256(rows[k].tobytes()).hexdigest() for k in rows}
    print(json.dumps(out))
"""


@pytest.mark.parametrize("qtype", ["Q4_K_M", "Q4_0"])
def test_expert_rows_through_the_gemm_are_one_row_decodes(wide, tmp_path, qtype):
    """Patch 0023: where several rows of a decode choose one Q4_K expert, mul_mat_id puts
    them four at a time through the repacked gemm (patch 0019: it sums a row as the gemv
    does). The wide model quantized to Q4_K_M (4 experts, 2 a row: a verify of 4 rows or
    more gives some expert 4): rows decoded 3, 4, 8, 16 and 40 at a time are bit for bit
    the rows decoded one at a time, and the same bits as one row at a time through the
    gemv (GGML_CPU_MMID_GEMM=0). A wrong row mapping, leftover or column slice would part
    them."""
    import json
    import os
    import subprocess
    import sys
    import textwrap

    path = quantize(wide, tmp_path / f"wide-{qtype}.gguf", qtype)

    def child(**env: str) -> dict:
        r = subprocess.run([sys.executable, "-c", textwrap.dedent(Q4K_ROWS), str(path)], capture_output=True,
                           text=True, env={**os.environ, **env}, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    gemm, gemv = child(), child(GGML_CPU_MMID_GEMM="0")
    assert gemm["finite"]
    assert all(gemm["lone"].values()), gemm["lone"]
    assert all(gemv["lone"].values()), gemv["lone"]
    assert gemm["sha"] == gemv["sha"]
