"""The cffi binding and typed wrappers over the patched llama.cpp."""
from __future__ import annotations

import gc
import os
from pathlib import Path

import numpy as np
import pytest

import stepmtp
from stepmtp import Batch, Context, LlamaError, Model, ModelLoadError


def test_version_and_system_info():
    assert stepmtp.__version__ and stepmtp.__version__ != "0.0.0+unknown"
    info = stepmtp.system_info()
    assert info["llama_cpp_commit"] == "0c1e57098"
    # the build carries this tree's whole series (a stale build fails here)
    series = sorted(p.name for p in (Path(__file__).resolve().parents[1] / "patches").glob("*.patch"))
    assert info["patches"] == series and series[0] == "0002-mtp-graph-output-rows.patch" and len(series) >= 9
    assert "CPU" in info["backend"]


def test_model_metadata(embedded_model):
    m = embedded_model
    assert m.meta("general.architecture") == "step35"
    assert m.n_mtp_blocks == 3 and m.n_mtp_blocks_loaded == 3 and m.has_mtp
    assert m.n_layer_trunk >= 2
    assert m.chat_template and "im_start" in m.chat_template


def test_tokenize_roundtrip(embedded_model):
    text = "def main():\n    return 42\n"
    toks = embedded_model.tokenize(text, add_special=False)
    assert len(toks) < len(text.encode())  # merges really merge
    assert embedded_model.detokenize(toks) == text
    assert b"".join(embedded_model.token_to_piece(t) for t in toks).decode() == text
    with pytest.raises(ValueError):
        embedded_model.detokenize([embedded_model.n_vocab])


def test_split_files_load(tiny):
    with Model(tiny["trunk"]) as trunk, Model(tiny["mtp"]) as mtp:
        assert trunk.n_mtp_blocks == 3 and trunk.n_mtp_blocks_loaded == 0
        assert mtp.has_mtp
        with pytest.raises(LlamaError, match="trunk-only"):
            Context(trunk, n_ctx=256, mtp=True)


def test_broken_model_names_missing_tensor_and_process_survives(tiny):
    # llama.cpp names the tensor that is not there (0.3.36: "tensor 'blk.6.attn_norm.weight' not found")
    with pytest.raises(ModelLoadError, match=r"tensor 'blk\.\d+\.[a-z_.]+'( not found|)"):
        Model(tiny["broken"])
    with Model(tiny["embedded"]) as m:  # the next load works
        assert m.has_mtp


def test_bad_files(tmp_path, tiny):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelLoadError, match="no such file"):
        Model(missing)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"this is not a model" * 100)
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        Model(junk)
    data = tiny["embedded"].read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="truncated.gguf"):
        Model(truncated)
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(data[:64])
    with pytest.raises(ModelLoadError):
        Model(header_only)


def test_wrong_architecture(tmp_path):
    import gguf

    path = tmp_path / "alien.gguf"
    w = gguf.GGUFWriter(str(path), "alien-arch")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="alien-arch"):
        Model(path)


def _prompt(model, n=12):
    toks = model.tokenize("import os\nimport sys\n\ndef main(argv):\n", add_special=False)
    assert len(toks) >= n
    return toks[:n]


def _mtp_decode(ctx, tokens, hidden, outputs="last"):
    b = Batch(len(tokens), n_embd=ctx.n_embd)
    b.fill(tokens, 0, outputs=outputs, embd=hidden)
    ctx.seq_rm(0)
    ctx.decode(b)


def test_mtp_offset_switches_heads_and_rejects_out_of_range(embedded_model):
    m = embedded_model
    toks = _prompt(m, 6)
    rng = np.random.default_rng(1)
    hidden = rng.standard_normal((len(toks), m.n_embd)).astype(np.float32)
    with Context(m, n_ctx=256, mtp=True) as ctx:
        ctx.set_nextn(True, masked=True)
        outs = []
        for k in range(3):
            ctx.mtp_offset = k
            assert ctx.mtp_offset == k
            _mtp_decode(ctx, toks, hidden)
            outs.append((ctx.logits(-1).copy(), ctx.nextn(1).copy()))
        for a in range(3):
            for b in range(a + 1, 3):
                assert not np.allclose(outs[a][0], outs[b][0], atol=1e-3)
                assert not np.allclose(outs[a][1], outs[b][1], atol=1e-3)
        with pytest.raises(ValueError, match="out of range"):
            ctx.mtp_offset = 3
        with pytest.raises(ValueError):
            ctx.mtp_offset = -1
        assert ctx.mtp_offset == 2  # unchanged, and the context still works:
        _mtp_decode(ctx, toks, hidden)
        np.testing.assert_allclose(ctx.logits(-1), outs[2][0], rtol=1e-5, atol=1e-5)
        # switching back never reuses the head-2 graph of the same shape
        ctx.mtp_offset = 0
        _mtp_decode(ctx, toks, hidden)
        np.testing.assert_allclose(ctx.logits(-1), outs[0][0], rtol=1e-5, atol=1e-5)
    with Context(m, n_ctx=256) as trunk_ctx:
        with pytest.raises(LlamaError, match="not an MTP context"):
            trunk_ctx.mtp_offset = 1


def test_mtp_graph_gathers_the_output_row(embedded_model):
    m = embedded_model
    toks = _prompt(m, 3)
    rng = np.random.default_rng(2)
    hidden = rng.standard_normal((3, m.n_embd)).astype(np.float32)
    with Context(m, n_ctx=256, mtp=True) as ctx:
        ctx.set_nextn(True, masked=True)
        for k in range(3):
            ctx.mtp_offset = k
            _mtp_decode(ctx, toks, hidden, outputs="all")
            all_logits = ctx.logits_rows(3).copy()
            all_h = ctx.nextn(3).copy()
            _mtp_decode(ctx, toks, hidden, outputs="last")
            last_logits = ctx.logits(-1).copy()
            last_h = ctx.nextn(1)[0].copy()
            np.testing.assert_allclose(last_logits, all_logits[2], rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(last_h, all_h[2], rtol=1e-4, atol=1e-4)
            assert not np.allclose(last_logits, all_logits[0], atol=1e-3)
            # unmasked: every row's hidden, the logits still only for the output row
            ctx.set_nextn(True, masked=False)
            _mtp_decode(ctx, toks, hidden, outputs="last")
            np.testing.assert_allclose(ctx.nextn(3), all_h, rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(ctx.logits(-1), all_logits[2], rtol=1e-4, atol=1e-4)
            ctx.set_nextn(True, masked=True)


def test_trunk_decode_logits_and_hidden(embedded_model):
    m = embedded_model
    toks = _prompt(m, 8)
    with Context(m, n_ctx=256) as ctx:
        ctx.set_nextn(True, masked=False)
        b = Batch(16)
        b.fill(toks, 0, outputs="all")
        ctx.decode(b)
        logits = ctx.logits_rows(len(toks)).copy()  # a view: the next decode overwrites it
        h = ctx.nextn(len(toks))
        assert np.isfinite(logits).all() and np.isfinite(h).all()
        assert h.shape == (8, m.n_embd)
        assert ctx.seq_pos_max(0) == 7
        ctx.seq_rm(0, 4)
        assert ctx.seq_pos_max(0) == 3
        with pytest.raises(ValueError, match="out of range"):
            b.fill([m.n_vocab + 5], 4)
            ctx.decode(b)
        b.fill(toks[4:], 4, outputs="all")  # still usable after the refusal
        ctx.decode(b)
        np.testing.assert_allclose(ctx.logits_rows(4), logits[4:], rtol=1e-4, atol=1e-4)


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc")
def test_load_free_cycles_do_not_grow_memory(tiny):
    def cycle():
        m = Model(tiny["embedded"])
        c = Context(m, n_ctx=128, n_batch=32, n_ubatch=32, mtp=True)
        c.close()
        m.close()

    for _ in range(10):
        cycle()
    gc.collect()
    before = _rss_mib()
    for _ in range(100):
        cycle()
    gc.collect()
    grown = _rss_mib() - before
    assert grown < 16, f"resident memory grew by {grown:.1f} MiB over 100 load/free cycles"


@pytest.mark.parametrize("n_threads", [1, 2])
def test_a_rows_logits_do_not_depend_on_how_many_rows_its_decode_carries(embedded_model, n_threads):
    """A verify's rows must be the one-row decodes' bits, or temperature-0 speculation
    drifts from plain decoding. The tiny model's weights are F32, which llama.cpp's CPU
    products of 2+ rows (llamafile's gemm) sum otherwise than one row: every row
    differed before patch 0010 (the Step files' F32 router did the same, rarely)."""
    m = embedded_model
    toks = (_prompt(m, 12) * 3)[:36]
    start = 24

    def rows(k: int) -> np.ndarray:
        with Context(m, n_ctx=256, n_threads=n_threads, n_threads_batch=n_threads) as ctx:
            b = Batch(64)
            b.fill(toks[:start], 0)
            ctx.decode(b)
            out = []
            for s in range(start, start + 8, k):
                b.fill(toks[s : s + k], s, outputs="all")
                ctx.decode(b)
                out.append(ctx.logits_rows(k).copy())
            return np.concatenate(out)

    one = rows(1)
    for k in (2, 4, 8):
        assert np.array_equal(rows(k), one), k


def test_graphs_are_kept_per_row_count_and_compute_the_same_bits(embedded_model, monkeypatch):
    """Patch 0015: speculative decoding alternates between row counts (a verify, then
    one token), and llama.cpp kept only the previous graph, so every change rebuilt and
    reallocated one (15% of a one-token decode on the bench model). Each shape's graph
    is now kept: built once, then reused, with the bits a rebuilt graph gives."""
    m = embedded_model
    toks = (_prompt(m, 12) * 4)[:48]
    shapes = [1, 4, 1, 4, 2, 1, 4, 1, 2, 4, 1]  # no two alike in a row

    def run(slots: int):
        monkeypatch.setenv("LLAMA_GRAPH_CACHE_SLOTS", str(slots))
        with Context(m, n_ctx=256) as ctx:
            b = Batch(64)
            b.fill(toks[:8], 0)
            ctx.decode(b)
            before = ctx.graphs_reused
            out, pos = [], 8
            for k in shapes:
                b.fill(toks[pos : pos + k], pos, outputs="all")
                ctx.decode(b)
                out.append(ctx.logits_rows(k).copy())
                pos += k
            return np.concatenate(out), ctx.graphs_reused - before, ctx.memory()["compute"]

    rebuilt, reused_without, compute_without = run(0)
    kept, reused_with, compute_with = run(8)
    assert np.array_equal(kept, rebuilt)
    assert reused_without == 0
    assert reused_with == len(shapes) - len(set(shapes))
    # the kept graphs' buffers are accounted as the context's
    assert compute_with > compute_without


@pytest.mark.parametrize("flash_attn", [True, False])
def test_a_decode_attends_past_other_sequences_cells_with_the_same_bits(embedded_model, flash_attn):
    """Patch 0011: in a unified cache a decode's K/V window starts at its own sequences'
    first cell (on the padding), not at cell 0: another slot's 300 cached cells below it
    are left out. Its logits must be those of the whole window to the bit, or
    speculation and plain decoding would part when other slots hold prompts. The
    comparison run decodes the same rows at the same cells beside a row of the other
    sequence, whose cells start at 0, so its window starts at 0 (the other row lands
    after it, patch 0014, and is taken back before the next decode)."""
    m = embedded_model
    other = (_prompt(m, 12) * 30)[:300]
    mine = (_prompt(m, 12) * 4)[:38]

    def rows(beside_cell_0: bool) -> np.ndarray:
        with Context(m, n_ctx=1024, n_seq_max=2, kv_unified=True, n_threads=1, n_threads_batch=1,
                     flash_attn=flash_attn) as ctx:
            b = Batch(512)
            b.fill(other, 0, seq=1, outputs="none")
            ctx.decode(b)
            b.fill(mine[:30], 0, seq=0)
            ctx.decode(b)
            out = []
            for k in range(8):
                b.fill(mine[30 + k : 31 + k], 30 + k, seq=0, outputs="all")
                if beside_cell_0:
                    b.append(other[k : k + 1], 300, seq=1, outputs="none")
                ctx.decode(b)
                out.append(ctx.logits_rows(1).copy())
                ctx.seq_rm(1, 300)
            return np.concatenate(out)

    assert np.array_equal(rows(False), rows(True))
