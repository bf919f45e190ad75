"""The bundled default model: a trained step35 model whose three MTP heads really predict.

Greedy decoding is deterministic for a given build, so the acceptance counts are too,
but only for that build: llama.cpp's CPU kernels are compiled for the build machine
(GGML_NATIVE) and other kernels round differently, so the greedy texts and every count
on them change from one CPU to another. What does not depend on rounding is tested
exactly; the acceptance bars sit below the spread measured across CPU builds (the
table in docs/bundled-model.md, tools/cpu_variants.sh).
"""
from __future__ import annotations

import ast
import json
from pathlib import Path

import numpy as np
import pytest

import gguf
from stepmtp import Engine, Model
from stepmtp.models import (
    DEFAULT_MODEL_FILE,
    EVAL_PROMPTS,
    OUT_OF_CORPUS_FILES,
    OUT_OF_CORPUS_PROMPTS,
    default_model_path,
    measure_acceptance,
    split_model,
)
from stepmtp.models import corpus as C

N_PREDICT = 160

# Statistical bars, about 20% below the lowest of four builds on this project's machine
# (AMD EPYC, AVX2): this tree's native build and three builds of an earlier tree for other
# CPU feature levels (AVX, SSE4.2, AVX2 without llamafile), whose greedy texts differ
# from the native build's (docs/bundled-model.md):
#                               held-in          out-of-corpus
#   chain n-max 3 rate          0.711 .. 0.732   0.766 .. 0.797
#   chain 3 - single 3          0.179 .. 0.198   0.209 .. 0.246
#   chain 2 - single 2          0.102 .. 0.118   0.097 .. 0.125
#   depth 1, every run          0.817 .. 0.853   0.864 .. 0.897
#   chain n-max 3 depth 2       0.704 .. 0.719   0.749 .. 0.792
#   chain n-max 3 depth 3       0.606 .. 0.648   0.678 .. 0.719
# Out of the corpus the bars are at least issue 17's (chain n-max 3 0.55, chain minus
# single 0.15, depth 3 0.35). They fail when the heads stop predicting (rates near 0) or
# chaining stops helping (the single head looped accepts about 0.5 at depth 2 and 0.2 to
# 0.28 at depth 3).
BARS = {
    "held-in": dict(chain3=0.57, diff3=0.14, diff2=0.08, d1=0.65, d2=0.56, d3=0.48),
    "out-of-corpus": dict(chain3=0.61, diff3=0.16, diff2=0.075, d1=0.69, d2=0.60, d3=0.54),
}


@pytest.fixture(scope="module")
def path() -> Path:
    return default_model_path()


@pytest.fixture(scope="module")
def split(path, tmp_path_factory) -> dict[str, Path]:
    return split_model(path, tmp_path_factory.mktemp("split"))


@pytest.fixture(scope="module")
def bench(path):
    # one thread: the model is small, and spinning threads fight over a busy machine
    return measure_acceptance(path, EVAL_PROMPTS, n_predict=N_PREDICT, n_threads=1)


@pytest.fixture(scope="module")
def bench_ooc(path):
    return measure_acceptance(path, OUT_OF_CORPUS_PROMPTS, n_predict=N_PREDICT, n_threads=1)


def test_bundled_file(path):
    assert path.name == DEFAULT_MODEL_FILE and path.parent.name == "models"
    assert path.stat().st_size <= 25 * 1024 * 1024
    r = gguf.GGUFReader(str(path))
    f = lambda k: r.fields[k].contents()  # noqa: E731
    assert f("general.architecture") == "step35"
    assert f("step35.nextn_predict_layers") == 3
    n_blocks = f("step35.block_count")
    n_layer = n_blocks - 3
    swa = f("step35.attention.sliding_window_pattern")
    assert any(swa[:n_layer]) and not all(swa[:n_layer]), "sliding-window and full-attention layers"
    assert f("step35.expert_gating_func") == int(gguf.ExpertGatingFuncType.SIGMOID)
    assert f("tokenizer.ggml.model") == "gpt2" and f("tokenizer.ggml.pre") == C.TOKENIZER_PRE
    assert "<|im_start|>" in f("tokenizer.chat_template")
    types = {t.name: t.tensor_type for t in r.tensors}
    names = set(types)
    dense = [il for il in range(n_layer) if f"blk.{il}.ffn_gate.weight" in names]
    moe = [il for il in range(n_layer) if f"blk.{il}.ffn_gate_inp.weight" in names]
    assert dense and moe
    for il in moe:
        assert {f"blk.{il}.exp_probs_b.bias", f"blk.{il}.ffn_up_shexp.weight"} <= names
    for il in range(n_blocks):
        assert {f"blk.{il}.attn_gate.weight", f"blk.{il}.attn_q_norm.weight", f"blk.{il}.attn_k_norm.weight"} <= names
    for il in range(n_layer, n_blocks):
        for t in ("eh_proj", "enorm", "hnorm", "shared_head_norm", "shared_head_head"):
            assert f"blk.{il}.nextn.{t}.weight" in names
    # norms stay F32, matrices are quantized
    assert all(types[n] == gguf.GGMLQuantizationType.F32 for n in names if n.endswith("norm.weight"))
    assert types["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.Q8_0


def test_loads_with_its_heads(path):
    with Model(path) as m:
        assert m.n_mtp_blocks == 3 and m.n_mtp_blocks_loaded == 3 and m.has_mtp
        assert m.chat_template and "<|im_start|>" in m.chat_template
        # Step-3.5-Flash's own template: reasoning and tool calls in the real format
        assert "<think>" in m.chat_template and "<function=" in m.chat_template


def test_split_pair(path, split):
    with Model(split["trunk"]) as t, Model(split["mtp"]) as d:
        assert t.n_mtp_blocks == 3 and t.n_mtp_blocks_loaded == 0
        assert d.n_mtp_blocks_loaded == 3
    r = gguf.GGUFReader(str(split["mtp"]))
    names = {t.name for t in r.tensors}
    assert "token_embd.weight" in names and "output.weight" in names and "blk.0.attn_q.weight" not in names


def _llama_vocab(path: Path) -> C.BPETokenizer:
    r = gguf.GGUFReader(str(path))
    return C.BPETokenizer(list(r.fields["tokenizer.ggml.tokens"].contents()),
                          list(r.fields["tokenizer.ggml.merges"].contents()))


@pytest.mark.parametrize("name", ["bisect.py", "copy.py", "fnmatch.py", "heapq.py", "base64.py", "codecs.py"])
def test_llama_cpp_tokenizes_like_training(path, name):
    """The model sees at inference the token ids it was trained on."""
    src = C.stdlib_dir() / name
    if not src.is_file():
        pytest.skip(f"{name} is not in this Python's stdlib")
    text = src.read_bytes().decode("utf-8")
    ours = _llama_vocab(path).encode(text)
    with Model(path) as m:
        assert m.tokenize(text, add_special=False) == ours
    assert len(ours) < len(text.encode()) / 2.5  # the merges are real


def test_temp0_identical_across_modes_and_files(path, split):
    prompts = EVAL_PROMPTS[:3]
    outs = {}
    with Engine(path, mode="none", n_ctx=1024, n_threads=1) as eng:
        ref = [eng.generate(p, n_predict=64, temperature=0).tokens for p in prompts]
    for mode, n_max in (("single", 1), ("single", 3), ("chain", 2), ("chain", 3)):
        with Engine(path, mode=mode, n_max=n_max, n_ctx=1024, n_threads=1, adaptive=False) as eng:
            outs[(mode, n_max)] = [eng.generate(p, n_predict=64, temperature=0).tokens for p in prompts]
    with Engine(split["trunk"], mtp_model=split["mtp"], mode="chain", n_max=3, n_ctx=1024, n_threads=1, adaptive=False) as eng:
        outs["split"] = [eng.generate(p, n_predict=64, temperature=0).tokens for p in prompts]
    for key, got in outs.items():
        assert got == ref, key


def test_writes_python(bench):
    """Greedy completions of the held-in prompts look like Python: every line's
    indentation is a multiple of 4 and most completions contain Python keywords.
    The texts change with the CPU build (see test_acceptance_bars); across the measured
    builds: keywords in 9/9 completions, 0.992 .. 1.0 of the lines indented by 4s,
    6/9 with 6+ lines that parse. The bars leave one, 0.09 and two prompts of room."""
    texts = bench[("chain", 3)]["texts"]
    kw = ("return", "if ", "self", "for ", "raise", "import", "def ", "else", "in ", "=")
    assert sum(any(k in t for k in kw) for t in texts) >= len(texts) - 1
    lines = [ln for t in texts for ln in t.splitlines() if ln.strip()]
    indents = [len(ln) - len(ln.lstrip(" ")) for ln in lines]
    assert np.mean([i % 4 == 0 for i in indents]) > 0.9
    # a good part of it parses: the longest prefix of whole lines that ast accepts
    parsed = 0
    for p, t in zip(EVAL_PROMPTS, texts):
        lines_ = (p + t).splitlines()
        for n in range(len(lines_), 1, -1):
            try:
                ast.parse("\n".join(lines_[:n]) + "\n" + " " * 8 + "pass\n")
            except SyntaxError:
                continue
            parsed += n >= 6
            break
    assert parsed >= len(texts) // 2


def _exact_checks(bench) -> None:
    """What holds in any build: the counts add up, every run drafts depths 1..n-max
    equally often and none deeper, a depth is accepted only after the one before it,
    and speculation never changes the greedy text."""
    texts = bench[("chain", 3)]["texts"]
    for (mode, n_max), r in bench.items():
        assert r["accepted"] == sum(r["accepted_per_depth"])
        assert r["drafted"] == sum(r["drafted_per_depth"])
        dpd, apd = r["drafted_per_depth"], r["accepted_per_depth"]
        assert dpd[0] > 0 and dpd[:n_max] == [dpd[0]] * n_max and not any(dpd[n_max:]), (mode, n_max, dpd)
        assert apd[0] >= apd[1] >= apd[2], (mode, n_max, apd)
        assert r["texts"] == texts, (mode, n_max)


def _depth_rates(r) -> list[float]:
    return [a / n for a, n in zip(r["accepted_per_depth"], r["drafted_per_depth"]) if n]


def _check_bars(bench, chain3: float, diff3: float, diff2: float, d1: float, d2: float, d3: float) -> None:
    """The statistical bars (see BARS): chain n-max 3's rate, what chaining adds over the
    looped single head at n-max 3 and 2; head 0 guesses the next token in every run and,
    chained, heads 1 and 2 keep a real share at depths 2 and 3."""
    c3, s3, c2, s2 = (bench[k] for k in (("chain", 3), ("single", 3), ("chain", 2), ("single", 2)))
    assert c3["rate"] >= chain3, c3
    assert c3["rate"] - s3["rate"] >= diff3, (c3["rate"], s3["rate"])
    assert c2["rate"] - s2["rate"] >= diff2, (c2["rate"], s2["rate"])
    for key, r in bench.items():
        assert _depth_rates(r)[0] > d1, key
    rates = _depth_rates(c3)
    assert rates[1] > d2 and rates[2] > d3, rates


def test_acceptance_bars(bench):
    _exact_checks(bench)
    _check_bars(bench, **BARS["held-in"])


def test_out_of_corpus_set(path):
    """The second prompt set is Python the model was not trained on: its modules are
    in neither the trunk's first corpus, nor its fine-tuning files, nor the heads' data
    (the file says what those left out), and each prompt is its module's text where
    this Python has the module."""
    assert len(OUT_OF_CORPUS_PROMPTS) == len(OUT_OF_CORPUS_FILES) == 9
    assert not set(OUT_OF_CORPUS_PROMPTS) & set(EVAL_PROMPTS)
    trunk = {p.name for p in C.corpus_files()}
    root = C.stdlib_dir()
    heads = {p.relative_to(root).as_posix() for p in C.head_corpus_files(OUT_OF_CORPUS_FILES)}
    for name, prompt in zip(OUT_OF_CORPUS_FILES, OUT_OF_CORPUS_PROMPTS):
        assert name not in trunk and name not in heads, name
        assert prompt.startswith("def ") and not prompt.endswith("\n"), name
        if (root / name).is_file():
            assert prompt in (root / name).read_text(encoding="utf-8"), name
    r = gguf.GGUFReader(str(path))
    data = json.loads(r.fields["stepmtp.heads_data"].contents())
    assert data["held_out"] == list(OUT_OF_CORPUS_FILES)
    assert data["files"] > 500 and data["onpolicy_seqs"] > 1000, data
    tune = json.loads(r.fields["stepmtp.finetune"].contents())
    assert tune["held_out"] == list(OUT_OF_CORPUS_FILES)
    assert tune["files"] == data["files"] and tune["tokens"] > 1_000_000, tune


def test_out_of_corpus_bars(bench_ooc):
    """Acceptance on Python the model was not trained on: neither its trunk nor its
    heads saw these modules (test_out_of_corpus_set)."""
    _exact_checks(bench_ooc)
    _check_bars(bench_ooc, **BARS["out-of-corpus"])
