"""llama.cpp's forward passes of the tiny model against a numpy reference of the same
maths (reference_mtp.py, float64).

Tolerance: 1e-4 absolute on logits and hidden rows (llama.cpp computes in float32
with an F32 KV cache and flash attention off; the measured error is ~4e-6)."""
from __future__ import annotations

import numpy as np
import pytest

from reference_mtp import mtp_block_forward, trunk_forward
from stepmtp import Batch, Context, Model

TOL = 1e-4


@pytest.fixture(scope="module")
def model(tiny):
    with Model(tiny["embedded"]) as m:
        yield m


def _prompt(model: Model) -> list[int]:
    # longer than the sliding window (16), so the window matters
    toks = model.tokenize("class Reader:\n    def read(self, path):\n        return open(path).read()\n")
    assert len(toks) > 20
    return toks


def test_trunk_matches_reference(model, tiny):
    toks = _prompt(model)
    with Context(model, n_ctx=256, type_k="f32", type_v="f32", flash_attn=False) as ctx:
        ctx.set_nextn(True, masked=False)
        b = Batch(len(toks))
        b.fill(toks, 0, outputs="all")
        ctx.decode(b)
        logits = ctx.logits_rows(len(toks)).copy()
        h = ctx.nextn(len(toks)).copy()
    ref_h, ref_logits = trunk_forward(tiny["embedded"], np.array(toks))
    np.testing.assert_allclose(h, ref_h, atol=TOL, rtol=0)
    np.testing.assert_allclose(logits, ref_logits, atol=TOL, rtol=0)


@pytest.mark.parametrize("head", [0, 1, 2])
@pytest.mark.parametrize("variant", ["embedded", "mtp"])
def test_mtp_block_matches_reference(tiny, head, variant):
    with Model(tiny[variant]) as m:
        toks = _prompt(m)
        rng = np.random.default_rng(head)
        h_in = rng.standard_normal((len(toks), m.n_embd)).astype(np.float32)
        with Context(m, n_ctx=256, mtp=True, type_k="f32", type_v="f32", flash_attn=False) as ctx:
            ctx.set_nextn(True, masked=True)
            ctx.mtp_offset = head
            b = Batch(len(toks), n_embd=m.n_embd)
            b.fill(toks, 0, outputs="all", embd=h_in)
            ctx.decode(b)
            logits = ctx.logits_rows(len(toks)).copy()
            h = ctx.nextn(len(toks)).copy()
    ref_h, ref_logits = mtp_block_forward(tiny[variant], head, np.array(toks), h_in)
    np.testing.assert_allclose(h, ref_h, atol=TOL, rtol=0)
    np.testing.assert_allclose(logits, ref_logits, atol=TOL, rtol=0)
