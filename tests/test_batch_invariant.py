"""Batch-invariant mode (patch 0012): each row of a small decode computed as a decode of
that row alone, so a verify's rows are plain decoding's bits on any backend.

This machine has no GPU, so the tests make the CPU behave like one: with
GGML_CPU_ROW_INVARIANT_ROWS=0 (patch 0010 off) llama.cpp's CPU products of 2+ rows of
the tiny model's F32 weights sum otherwise than one row does, as CUDA's kernels do. The
environment is read once per process: those checks run in a child process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from stepmtp import Batch, Context, Engine


def _child(code: str, *args: str, **env: str) -> dict:
    """Run ``code`` (with ``args``) in a fresh interpreter with ``env`` added; it prints
    one JSON line."""
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                       env={**os.environ, "STEPMTP_N_THREADS": "1", **env}, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


ROWS = r"""
    import json, sys
    import numpy as np
    from stepmtp import Batch, Context, Model

    m = Model(sys.argv[1])
    toks = m.tokenize("import os\nimport sys\n\ndef main(argv):\n", add_special=False)[:12]
    other = m.tokenize("class Point:\n    def __init__(self, x, y):\n", add_special=False)[:12]
    toks, other = (toks * 4)[:40], (other * 4)[:40]
    start = 24

    def rows(k, invariant, flash_attn, two_seqs, unified, apart=False):
        # {(seq, pos): logits} of rows start..start+8 of one sequence decoded k at a
        # time, beside as many rows of a second one when two_seqs (a stream of its own,
        # or sharing a unified cache), in the same decodes, or in decodes of their own
        # when apart
        got = {}
        with Context(m, n_ctx=512, n_seq_max=2, n_threads=1, n_threads_batch=1, flash_attn=flash_attn,
                     kv_unified=unified) as ctx:
            ctx.batch_invariant = 16 if invariant else 0
            b = Batch(64)
            b.fill(toks[:start], 0, seq=0, outputs="none")
            if two_seqs:
                b.append(other[:start], 0, seq=1)
            ctx.decode(b)
            seqs = [(0, toks), (1, other)] if two_seqs else [(0, toks)]
            for s in range(start, start + 8, k):
                for group in ([[x] for x in seqs] if apart else [seqs]):
                    b.clear()
                    for seq, tt in group:
                        b.append(tt[s : s + k], s, seq=seq, outputs="all")
                    ctx.decode(b)
                    lg = ctx.logits_rows(b.n).copy()
                    for j, (seq, _) in enumerate(group):
                        for i in range(k):
                            got[(seq, s + i)] = lg[j * k + i]
        return got

    def same(a, b):
        return a.keys() == b.keys() and all(np.array_equal(a[x], b[x]) for x in a)

    res = {}
    # left out: flash attention off, two sequences in a unified cache. Decoded together
    # their rows take cells in another order than decoded one sequence at a time, and
    # attention without flash attention sums the cells in SIMD lanes by cell index, so
    # those rows part by the same bits with the mode, without it, and with patch 0010
    # on: where the cells lie, not how many rows a kernel saw (flash attention sums a
    # row's cells one by one in cell order; separate streams keep each sequence's order)
    for fa, two, unified in ((True, False, False), (True, True, False), (True, True, True),
                             (False, False, False), (False, True, False)):
        one = rows(1, False, fa, two, unified, apart=True)  # every row decoded alone
        res[f"fa={fa} two={two} unified={unified}"] = {
            "plain_4_equal": same(rows(4, False, fa, two, unified), one),
            "invariant": [same(rows(k, True, fa, two, unified), one) for k in (1, 2, 4, 8)],
        }
    print(json.dumps(res))
"""


def test_rows_are_one_row_decodes_on_a_cpu_whose_kernels_depend_on_the_batch(tiny):
    """Without the mode, 4-row decodes differ from 1-row ones (that is the GPU-like
    CPU); with it, rows of 2, 4 and 8-row decodes equal the 1-row decodes bit for bit:
    one sequence or two (each its own stream), with flash attention or without, and two
    in a unified cache with flash attention."""
    res = _child(ROWS, str(tiny["embedded"]), GGML_CPU_ROW_INVARIANT_ROWS="0")
    if all(r["plain_4_equal"] for r in res.values()):
        pytest.skip("this CPU's kernels sum 4 rows as 1 even without patch 0010: nothing to show")
    for key, r in res.items():
        assert r["invariant"] == [True, True, True, True], key


def test_speculation_equals_plain_decoding_there(tiny):
    """End to end on that CPU, temperature 0: with the mode, the chained heads' text is
    plain decoding's for one sequence and for two decoded together."""
    code = f"""
        import json
        from stepmtp import Engine
        prompts = ["import os\\nimport sys\\n", "class Point:\\n    def"]
        out = {{}}
        for mode in ("none", "chain"):
            with Engine({str(tiny["embedded"])!r}, mode=mode, n_max=3, n_ctx=512, n_parallel=2,
                        batch_invariant=True, adaptive=False) as eng:
                one = eng.generate(prompts[0], n_predict=48, temperature=0).text
                both = [r.text for r in eng.generate_many(prompts, n_predict=48, temperature=0)]
                out[mode] = [one, *both]
                if mode == "chain":
                    out["drafted"] = eng.generate(prompts[0], n_predict=48, temperature=0).stats.n_drafted
        print(json.dumps(out))
    """
    res = _child(code, GGML_CPU_ROW_INVARIANT_ROWS="0")
    assert res["drafted"] > 0
    assert res["chain"] == res["none"]


def test_the_mode_changes_nothing_where_rows_already_agree(tiny):
    """On this CPU with patch 0010 rows are invariant already: the mode's split graph
    gives the same bits (a wrong view or join would not)."""
    m_path = tiny["embedded"]
    outs = {}
    for invariant in (False, True):
        with Engine(m_path, mode="chain", n_max=3, n_ctx=512, n_parallel=2, batch_invariant=invariant,
                    adaptive=False) as eng:
            assert eng.target.batch_invariant == (8 if invariant else 0)
            outs[invariant] = [(r.text, r.stats.n_accepted) for r in
                               eng.generate_many(["def f(x):\n", "import re\n"], n_predict=40, temperature=0)]
    assert outs[True] == outs[False]


def test_the_setter(embedded_model):
    with Context(embedded_model, n_ctx=128, n_threads=1) as ctx:
        toks = embedded_model.tokenize("import os\n", add_special=False)
        b = Batch(16)
        ctx.batch_invariant = 4
        assert os.environ.get("GGML_CUDA_DISABLE_FUSION") == "1"  # CUDA: the fused chains differ
        b.fill(toks[:4], 0, outputs="all")
        ctx.decode(b)
        a = ctx.logits_rows(4).copy()
        ctx.batch_invariant = 0  # off again: the unsplit graph, same bits on this CPU
        ctx.seq_rm(0)
        ctx.decode(b)
        assert np.array_equal(ctx.logits_rows(4), a) and ctx.batch_invariant == 0
        with pytest.raises(ValueError):
            ctx.batch_invariant = -1


def test_the_server_flag(tiny, tmp_path):
    """``--spec-batch-invariant`` puts the server's target in the mode (in /props and
    its log) and its temperature-0 text is plain decoding's."""
    import httpx

    from test_server import ServerProcess

    srv = ServerProcess(["-m", str(tiny["embedded"]), "--spec-type", "draft-mtp", "--spec-batch-invariant",
                         "-np", "2", "-c", "1024", "-t", "1"], tmp_path)
    try:
        srv.wait_ready()
        props = httpx.get(srv.url + "/props", timeout=30).json()
        body = httpx.post(srv.url + "/completion", json={"prompt": "def f(x):\n", "n_predict": 32,
                                                         "temperature": 0}, timeout=60).json()
        log = srv.log()
    finally:
        srv.stop()
    assert props["stepmtp"]["batch_invariant"] == 2 * (3 + 1)
    assert "batch-invariant target: decodes of up to 8 rows" in log
    assert body["mtp"]["draft_n"] > 0
    with Engine(tiny["embedded"], mode="none", n_ctx=512, n_threads=1) as eng:
        assert body["content"] == eng.generate("def f(x):\n", n_predict=32, temperature=0).text


def _f16_tiny(tmp_path):
    """The tiny model with every matrix F16, the experts too (patch 0016's tiles)."""
    import gguf

    from stepmtp.tiny import CONFIG, _select, _write_gguf, build_vocab, make_tensors

    tensors = _select(make_tensors(CONFIG, 0), CONFIG, "embedded")
    types = {n: gguf.GGMLQuantizationType.F16 for n, a in tensors if a.ndim >= 2 and "norm" not in n}
    assert any("exps" in n for n in types) and len(types) > 10
    path = tmp_path / "tiny-f16.gguf"
    _write_gguf(path, CONFIG, build_vocab(CONFIG), tensors, with_nextn=True, seed=0, variant="embedded",
                file_type=gguf.LlamaFileType.MOSTLY_F16, tensor_types=types)
    return path


def test_f16_weights_rows_at_once_are_one_row_decodes(tmp_path):
    """Patch 0016: F16 weights multiply a decode's few rows by tiles (each loaded weight
    vector serving several rows), each pair summed as a one-row product sums it. The tiny
    model with every matrix F16, the experts too: rows decoded 2, 3, 4, 5, 8 and 16 at a
    time (tiles of 2 and 4 rows and what is left) are bit for bit the rows decoded one at
    a time, and a wrong row stride, tile or leftover would part them."""
    from stepmtp import Model

    m = Model(_f16_tiny(tmp_path))
    try:
        toks = (m.tokenize("import os\nimport sys\n\ndef main(argv):\n", add_special=False) * 8)[:48]
        start, n = 16, 16

        def rows(k):
            with Context(m, n_ctx=256, n_threads=2, n_threads_batch=2) as ctx:
                b = Batch(64)
                b.fill(toks[:start], 0, outputs="none")
                ctx.decode(b)
                out = []
                for s in range(start, start + n, k):
                    b.fill(toks[s : min(s + k, start + n)], s, outputs="all")
                    ctx.decode(b)
                    out.append(ctx.logits_rows(b.n).copy())
                return np.concatenate(out)

        one = rows(1)
        assert np.isfinite(one).all() and one.std() > 0
        for k in (2, 3, 4, 5, 8, 16):
            got = rows(k)
            assert np.array_equal(got, one), f"{k} rows at a time: row {np.flatnonzero((got != one).any(1))[0]} differs"
    finally:
        m.close()


F16_LOGITS = r"""
    import hashlib, json, sys
    from stepmtp import Batch, Context, Model

    m = Model(sys.argv[1])
    toks = (m.tokenize("import os\nimport sys\n\ndef main(argv):\n", add_special=False) * 8)[:48]
    out = {}
    with Context(m, n_ctx=256, n_threads=1, n_threads_batch=1) as ctx:
        b = Batch(64)
        b.fill(toks[:40], 0, seq=0, outputs="all")  # a prompt: each expert takes several of 40 rows
        ctx.decode(b)
        out["prompt"] = hashlib.sha256(ctx.logits_rows(40).tobytes()).hexdigest()
        b.fill(toks[40:44], 40, seq=0, outputs="all")  # a verify's 4 rows
        ctx.decode(b)
        out["verify"] = hashlib.sha256(ctx.logits_rows(4).tobytes()).hexdigest()
    print(json.dumps(out))
"""


FA_LOGITS = r"""
    import hashlib, json, sys
    import numpy as np
    from stepmtp import Batch, Context, Model

    m = Model(sys.argv[1])
    toks = (m.tokenize("import os\nimport sys\n\ndef main(argv):\n", add_special=False) * 40)[:300]
    out, rows = {}, {}
    with Context(m, n_ctx=512, n_threads=1, n_threads_batch=1, flash_attn=True) as ctx:
        b = Batch(256)
        b.fill(toks[:250], 0, seq=0, outputs="none")
        ctx.decode(b)
        for k in (1, 4, 13, 40):  # a decode, verifies, a prompt chunk under 64 rows
            b.fill(toks[250:250 + k], 250, seq=0, outputs="all")
            ctx.decode(b)
            rows[k] = ctx.logits_rows(k).copy()
            out[str(k)] = hashlib.sha256(rows[k].tobytes()).hexdigest()
            ctx.seq_rm(0, 250, -1)
        lone = []
        for j in range(40):  # the same rows, one decode each
            b.fill(toks[250 + j:251 + j], 250 + j, seq=0, outputs="all")
            ctx.decode(b)
            lone.append(ctx.logits_rows(1)[0].copy())
        out["lone"] = all(np.array_equal(rows[k], np.stack(lone[:k])) for k in rows)
    print(json.dumps(out))
"""


def test_flash_attention_rows_change_no_bit(tmp_path):
    """Patch 0020 runs several query rows of a head together on flash attention's one-row
    path, each KV cell read once for them: every row must keep the lone row's result,
    the one-row loop's (GGML_CPU_FA_ROWS=0), bit for bit, after 250 cells."""
    path = _f16_tiny(tmp_path)
    together = _child(FA_LOGITS, str(path))
    loop = _child(FA_LOGITS, str(path), GGML_CPU_FA_ROWS="0")
    assert together["lone"] and loop["lone"]
    assert together == loop


def test_flash_attention_span_changes_no_bit(tmp_path):
    """Patch 0022 runs flash attention's cell loop over the span between a row's first
    and last unmasked cells only: the tiny model's sliding-window layers (a window of 16
    in a ring of the whole cache) and the causal tails leave most cells out, and every
    row must keep what visiting each cell gave (GGML_CPU_FA_SPAN=0), bit for bit, alone
    and in verifies of 4, 13 and 40 rows."""
    path = _f16_tiny(tmp_path)
    span = _child(FA_LOGITS, str(path))
    every = _child(FA_LOGITS, str(path), GGML_CPU_FA_SPAN="0")
    assert span["lone"] and every["lone"]
    assert span == every


def test_f16_tiles_change_no_bit(tmp_path):
    """Patch 0016 multiplies F16 weights by a few rows at a time in tiles, dense products
    of a decode's rows and an expert's rows of any batch (a prompt's too); every pair must
    keep the sum of the one-pair loop (GGML_CPU_F16_TILES=0): ggml_vec_dot_f16's, or on
    AVX2 builds patch 0021's one chain, whose tiles have other shapes again (4 weight rows
    for a decode's row, 6 / 4 / 3 for 2 / 3 / 4 rows). The tiny model with every matrix
    F16, its logits compared bit for bit."""
    path = _f16_tiny(tmp_path)
    tiles = _child(F16_LOGITS, str(path))
    loops = _child(F16_LOGITS, str(path), GGML_CPU_F16_TILES="0")
    assert tiles == loops
