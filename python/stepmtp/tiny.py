"""Deterministic tiny Step-3.5/3.7-Flash (``step35``) GGUF generator for tests.

The files written here mimic what ``conversion/step3.py`` (``Step35Model``)
emits for the real checkpoint -- same architecture string, metadata keys,
tensor names, shapes and layout quirks -- so that llama.cpp runs exactly the
same loader and graph code paths, only with a model small enough to build in
milliseconds and to check against a numpy reference.

Features exercised on purpose (each a code path a converted Step-3.5/3.7-Flash
GGUF can take in llama.cpp; the exact values are the tiny model's own):

* sliding-window and full-attention layers mixed in the trunk *and* across the
  MTP blocks (period-4 pattern ``full, swa, swa, swa``), with a different
  query-head count per attention kind (``attention_other_setting`` in HF),
  partial RoPE on full layers (half the head dim), full-dim RoPE on SWA layers,
  different rope bases for both kinds and Llama-3 style ``rope_freqs``;
* per-head q/k RMSNorm, GQA and the head-wise sigmoid attention gate;
* one leading dense FFN layer, then MoE layers with sigmoid routing, a
  selection-only router bias, weight normalisation + scaling and a shared
  expert, plus a per-layer SwiGLU clamp on the last trunk layer;
* ``nextn_predict_layers = 3`` MTP blocks appended as ``blk.4..blk.6``, each a
  full decoder layer with a dense MLP and the NextN wiring
  (``eh_proj``, ``enorm``, ``hnorm``, ``shared_head_norm``, ``shared_head_head``);
* a real byte-level BPE tokenizer (``gpt2`` model, ``default`` pre-tokenizer)
  with ChatML control tokens and a jinja chat template.

Usage::

    python -m stepmtp.tiny --out DIR [--seed N]

or::

    from stepmtp.tiny import write_tiny_models
    paths = write_tiny_models(out_dir, seed=0)   # {"embedded": Path, ...}

Only numpy and the ``gguf`` package are needed.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np

import gguf

ARCH = "step35"

#: File name of each variant written by :func:`write_tiny_models`.
VARIANT_FILES: dict[str, str] = {
    # trunk + all 3 MTP blocks in one file (what the converter writes by default)
    "embedded": "tiny-embedded.gguf",
    # trunk tensors only, but metadata still declares the 3 MTP blocks
    "trunk": "tiny-trunk.gguf",
    # MTP blocks + token_embd + output_norm + output (converter's --mtp)
    "mtp": "tiny-mtp.gguf",
    # 3 MTP blocks declared, the last one (blk.6) missing entirely
    "broken": "tiny-broken.gguf",
    # plain trunk model, no nextn key, block_count = trunk layers (converter's --no-mtp)
    "nomtp": "tiny-nomtp.gguf",
}

#: Small built-in English sample the BPE merges are learned from.  Changing it
#: changes the vocabulary (and so every token id) -- treat it as frozen.
SAMPLE_TEXT = """\
Speculative decoding lets a small draft model guess several tokens ahead, and the
large target model then checks all of those guesses in a single batched forward
pass. When the guesses are right, many tokens are accepted at once and the text is
produced much faster; when a guess is wrong, the target model simply keeps its own
token and the draft starts again from there. The output is exactly the same as
plain greedy decoding, only the time it takes is different.
Multi token prediction heads are a cheap kind of draft model. Each head is one
extra transformer layer that reads the hidden state of the main model together
with the embedding of the next token, and predicts the token after that. Chaining
the heads one after another gives a draft of three tokens for the price of three
small layers. The first head sees the hidden state of the trunk, the second head
sees the hidden state of the first head, and the third head sees the second.
The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun.
A sliding window attention layer only looks at the most recent tokens, while a
full attention layer can look at every token in the context. Mixing both kinds of
layers keeps long contexts cheap without losing the ability to recall old facts.
Rotary position embeddings rotate pairs of query and key features by an angle that
grows with the position, so that attention scores depend on relative distance.
Mixture of experts layers route every token to a few expert networks chosen by a
router, and a shared expert that every token uses. The router adds a small bias
that only changes which experts are chosen, never how much each one counts.
Hello world, this is a tiny model with random weights. It knows nothing at all,
but it is small, fast and deterministic, which is exactly what a test needs.
"""

#: Control tokens appended after the BPE tokens, in id order.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|im_start|>",
    "<|im_end|>",
)

#: ChatML-like jinja template stored as ``tokenizer.chat_template``.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)


@dataclass(frozen=True)
class TinyConfig:
    """Hyper-parameters of the tiny model, as llama.cpp will see them.

    Layer indices ``il`` run over all blocks: ``0 .. n_layer-1`` is the trunk,
    ``n_layer .. n_layer_all-1`` the MTP blocks.
    """

    n_embd: int = 64
    n_layer: int = 4                 # trunk blocks (blk.0..blk.3)
    n_nextn: int = 3                 # MTP blocks (blk.4..blk.6)
    head_dim: int = 16               # key_length == value_length
    n_head_full: int = 4             # query heads on full-attention layers
    n_head_swa: int = 6              # query heads on sliding-window layers
    n_head_kv: int = 2               # kv heads on every layer
    swa_period: int = 4              # layer il is full attention iff il % swa_period == 0
    n_swa: int = 16                  # sliding window (keys with q_pos - k_pos < n_swa are visible)
    n_ff: int = 96                   # dense MLP width (layer 0 and the MTP blocks)
    n_ff_exp: int = 32               # routed expert width
    n_ff_shexp: int = 48             # shared expert width
    n_expert: int = 4
    n_expert_used: int = 2
    n_leading_dense: int = 1         # trunk layers before the first MoE layer
    n_ctx_train: int = 4096
    rope_freq_base: float = 500000.0      # full-attention layers
    rope_freq_base_swa: float = 10000.0   # sliding-window layers
    # Llama-3 rope scaling -> rope_freqs.weight (used by full-attention layers only)
    rope_llama3_factor: float = 2.0
    rope_llama3_low_freq_factor: float = 1.0
    rope_llama3_high_freq_factor: float = 4.0
    rope_llama3_orig_ctx: int = 8192
    rms_eps: float = 1e-5
    expert_weights_scale: float = 3.0
    expert_weights_norm: bool = True
    # per trunk layer; the MTP blocks are padded with 0.0 (= no clamp) like the converter does
    swiglu_clamp_exp_trunk: tuple[float, ...] = (0.0, 0.0, 0.0, 1.5)
    swiglu_clamp_shexp_trunk: tuple[float, ...] = (0.0, 0.0, 0.0, 1.5)
    n_vocab: int = 512
    special_tokens: tuple[str, ...] = field(default=SPECIAL_TOKENS)
    bos_token: str = "<|begin_of_text|>"
    eos_token: str = "<|im_end|>"
    pad_token: str = "<|end_of_text|>"

    # ---- derived values -------------------------------------------------

    @property
    def n_layer_all(self) -> int:
        """``step35.block_count`` of a file that declares the MTP blocks."""
        return self.n_layer + self.n_nextn

    @property
    def mtp_layers(self) -> tuple[int, ...]:
        """Block indices of the MTP heads, in chain order."""
        return tuple(range(self.n_layer, self.n_layer_all))

    def is_swa(self, il: int) -> bool:
        """Whether block ``il`` uses sliding-window attention."""
        return il % self.swa_period != 0

    def n_head(self, il: int) -> int:
        return self.n_head_swa if self.is_swa(il) else self.n_head_full

    def n_rot(self, il: int) -> int:
        """Rotary dims of block ``il``: llama.cpp halves n_rot for full layers only."""
        return self.head_dim if self.is_swa(il) else self.head_dim // 2

    def rope_base(self, il: int) -> float:
        return self.rope_freq_base_swa if self.is_swa(il) else self.rope_freq_base

    def is_moe(self, il: int) -> bool:
        """MoE FFN on trunk layers past the leading dense ones; MTP blocks are dense."""
        return self.n_leading_dense <= il < self.n_layer

    def swa_pattern(self, n_blocks: int) -> list[bool]:
        return [self.is_swa(il) for il in range(n_blocks)]

    def swiglu_clamp_exp(self, n_blocks: int) -> list[float]:
        return _pad([float(v) for v in self.swiglu_clamp_exp_trunk], n_blocks, 0.0)

    def swiglu_clamp_shexp(self, n_blocks: int) -> list[float]:
        return _pad([float(v) for v in self.swiglu_clamp_shexp_trunk], n_blocks, 0.0)

    @property
    def n_merges_vocab(self) -> int:
        """Number of BPE-merged tokens between the 256 byte tokens and the specials."""
        return self.n_vocab - 256 - len(self.special_tokens)

    @property
    def bos_id(self) -> int:
        return self.n_vocab - len(self.special_tokens) + self.special_tokens.index(self.bos_token)

    @property
    def eos_id(self) -> int:
        return self.n_vocab - len(self.special_tokens) + self.special_tokens.index(self.eos_token)

    @property
    def pad_id(self) -> int:
        return self.n_vocab - len(self.special_tokens) + self.special_tokens.index(self.pad_token)

    def token_id(self, special: str) -> int:
        """Id of one of :attr:`special_tokens`."""
        return self.n_vocab - len(self.special_tokens) + self.special_tokens.index(special)


#: The configuration every variant is written with.
CONFIG = TinyConfig()


def _pad(values: Sequence[float], n: int, default: float) -> list[float]:
    out = list(values)[:n]
    return out + [default] * (n - len(out))


# ---------------------------------------------------------------------------
# tokenizer
# ---------------------------------------------------------------------------


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character map."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


@dataclass(frozen=True)
class TinyVocab:
    """Byte-level BPE vocabulary in the form ``tokenizer.ggml.*`` expects."""

    tokens: list[str]
    token_types: list[int]
    merges: list[str]


def build_vocab(cfg: TinyConfig = CONFIG, text: str = SAMPLE_TEXT) -> TinyVocab:
    """Learn BPE merges on ``text`` until the vocabulary has ``cfg.n_vocab`` tokens.

    Ids ``0..255`` are the byte tokens (id == byte value), then the merged tokens
    in merge order, then the control tokens.  Ties between equally frequent pairs
    are broken lexicographically so the result never depends on hash order.
    """
    b2u = bytes_to_unicode()
    # llama.cpp's "default" pre-tokenizer splits off letters with an optional
    # leading space; training only on those words keeps every merge reachable.
    words = Counter(re.findall(r" ?[A-Za-z]+", text))
    seqs: dict[str, list[str]] = {w: [b2u[b] for b in w.encode("utf-8")] for w in sorted(words)}

    tokens = [b2u[b] for b in range(256)]
    known = set(tokens)
    merges: list[str] = []
    n_target = cfg.n_merges_vocab
    n_new = 0
    while n_new < n_target:
        pairs: Counter[tuple[str, str]] = Counter()
        for w, seq in seqs.items():
            for a, b in zip(seq, seq[1:]):
                pairs[(a, b)] += words[w]
        if not pairs:
            raise ValueError(f"sample text too small: only {n_new} of {n_target} merges learned")
        best = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))[0]
        merged = best[0] + best[1]
        merges.append(f"{best[0]} {best[1]}")
        # two different pairs can spell the same string; llama.cpp requires unique token texts
        if merged not in known:
            known.add(merged)
            tokens.append(merged)
            n_new += 1
        for w, seq in seqs.items():
            i, out = 0, []
            while i < len(seq):
                if i + 1 < len(seq) and seq[i] == best[0] and seq[i + 1] == best[1]:
                    out.append(merged)
                    i += 2
                else:
                    out.append(seq[i])
                    i += 1
            seqs[w] = out

    types = [int(gguf.TokenType.NORMAL)] * len(tokens)
    tokens += list(cfg.special_tokens)
    types += [int(gguf.TokenType.CONTROL)] * len(cfg.special_tokens)
    assert len(tokens) == cfg.n_vocab, (len(tokens), cfg.n_vocab)
    return TinyVocab(tokens=tokens, token_types=types, merges=merges)


# ---------------------------------------------------------------------------
# weights
# ---------------------------------------------------------------------------


def llama3_rope_factors(cfg: TinyConfig = CONFIG) -> np.ndarray:
    """``rope_freqs.weight`` exactly as ``Step35Model.generate_extra_tensors`` computes it."""
    rotary_dim = cfg.head_dim // 2  # partial_rotary_factor 0.5 of the full-attention layers
    base = cfg.rope_freq_base
    freqs = 1.0 / (base ** (np.arange(0, rotary_dim, 2, dtype=np.float32) / rotary_dim))
    low_wavelen = cfg.rope_llama3_orig_ctx / cfg.rope_llama3_low_freq_factor
    high_wavelen = cfg.rope_llama3_orig_ctx / cfg.rope_llama3_high_freq_factor
    factors: list[float] = []
    for freq in freqs:
        wavelen = 2 * math.pi / float(freq)
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(cfg.rope_llama3_factor)
        else:
            smooth = (cfg.rope_llama3_orig_ctx / wavelen - cfg.rope_llama3_low_freq_factor) / (
                cfg.rope_llama3_high_freq_factor - cfg.rope_llama3_low_freq_factor
            )
            factors.append(1.0 / ((1.0 - smooth) / cfg.rope_llama3_factor + smooth))
    # padded to head_dim/2 with 1.0 so the full-dim SWA rotation would stay neutral
    factors += [1.0] * (cfg.head_dim // 2 - len(factors))
    return np.asarray(factors, dtype=np.float32)


def make_tensors(cfg: TinyConfig = CONFIG, seed: int = 0) -> dict[str, np.ndarray]:
    """All tensors of the full (trunk + MTP) model, keyed by GGUF name.

    Shapes are numpy (row-major) shapes, i.e. the reverse of llama.cpp's ``ne``:
    a ggml ``{n_in, n_out}`` matrix is stored as ``(n_out, n_in)`` and applied
    as ``W @ x``.  Every variant slices this one dict, so the trunk and MTP
    weights are identical across variants for a given seed.
    """
    rng = np.random.default_rng(seed)
    E, hd, V = cfg.n_embd, cfg.head_dim, cfg.n_vocab

    def mat(n_out: int, n_in: int, gain: float = 1.0, *lead: int) -> np.ndarray:
        # 1/sqrt(fan_in) keeps every projection's output at roughly unit scale
        w = rng.standard_normal((*lead, n_out, n_in)) * (gain / math.sqrt(n_in))
        return w.astype(np.float32)

    def norm(n: int) -> np.ndarray:
        # the converter stores HF's zero-centred norms as 1 + w
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    t: dict[str, np.ndarray] = {}
    t["token_embd.weight"] = rng.standard_normal((V, E)).astype(np.float32)

    for il in range(cfg.n_layer_all):
        p = f"blk.{il}."
        nh, nkv = cfg.n_head(il), cfg.n_head_kv
        if il >= cfg.n_layer:
            t[p + "nextn.enorm.weight"] = norm(E)
            t[p + "nextn.hnorm.weight"] = norm(E)
            t[p + "nextn.eh_proj.weight"] = mat(E, 2 * E)
        t[p + "attn_norm.weight"] = norm(E)
        t[p + "attn_q.weight"] = mat(nh * hd, E)
        t[p + "attn_k.weight"] = mat(nkv * hd, E)
        t[p + "attn_v.weight"] = mat(nkv * hd, E)
        t[p + "attn_q_norm.weight"] = norm(hd)
        t[p + "attn_k_norm.weight"] = norm(hd)
        # gain 2 so that sigmoid(gate) spreads over (0, 1) instead of sitting at 0.5
        t[p + "attn_gate.weight"] = mat(nh, E, 2.0)
        t[p + "attn_output.weight"] = mat(E, nh * hd, 0.7)
        t[p + "ffn_norm.weight"] = norm(E)
        if cfg.is_moe(il):
            X, F, S = cfg.n_expert, cfg.n_ff_exp, cfg.n_ff_shexp
            # gain 3 on the router so that different tokens pick different experts
            t[p + "ffn_gate_inp.weight"] = mat(X, E, 3.0)
            t[p + "exp_probs_b.bias"] = (0.2 * rng.standard_normal(X)).astype(np.float32)
            t[p + "ffn_gate_exps.weight"] = mat(F, E, 1.0, X)
            t[p + "ffn_up_exps.weight"] = mat(F, E, 1.0, X)
            # routed outputs get multiplied by expert_weights_scale; undo it here
            t[p + "ffn_down_exps.weight"] = mat(E, F, 0.7 / cfg.expert_weights_scale, X)
            t[p + "ffn_gate_shexp.weight"] = mat(S, E)
            t[p + "ffn_up_shexp.weight"] = mat(S, E)
            t[p + "ffn_down_shexp.weight"] = mat(E, S, 0.7)
        else:
            t[p + "ffn_gate.weight"] = mat(cfg.n_ff, E)
            t[p + "ffn_up.weight"] = mat(cfg.n_ff, E)
            t[p + "ffn_down.weight"] = mat(E, cfg.n_ff, 0.7)
        if il >= cfg.n_layer:
            t[p + "nextn.shared_head_norm.weight"] = norm(E)
            # gain 3: logits with std ~3 are peaked enough to be decisive, not degenerate
            t[p + "nextn.shared_head_head.weight"] = mat(V, E, 3.0)

    t["output_norm.weight"] = norm(E)
    t["output.weight"] = mat(V, E, 3.0)
    t["rope_freqs.weight"] = llama3_rope_factors(cfg)
    return t


# ---------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------


def _block_of(name: str) -> int | None:
    m = re.match(r"blk\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def _select(tensors: Mapping[str, np.ndarray], cfg: TinyConfig, variant: str) -> list[tuple[str, np.ndarray]]:
    out = []
    for name, arr in tensors.items():
        bid = _block_of(name)
        is_mtp = bid is not None and bid >= cfg.n_layer
        if variant == "embedded":
            keep = True
        elif variant in ("trunk", "nomtp"):
            keep = not is_mtp
        elif variant == "mtp":
            # converter --mtp keeps the MTP blocks plus embed/norm/lm_head; rope_freqs
            # is generated separately from the HF tensors so it is written too
            keep = is_mtp or bid is None
        elif variant == "broken":
            keep = bid != cfg.n_layer_all - 1
        else:
            raise ValueError(f"unknown variant {variant!r}")
        if keep:
            out.append((name, arr))
    return out


def _write_gguf(
    path: Path,
    cfg: TinyConfig,
    vocab: TinyVocab,
    tensors: Iterable[tuple[str, np.ndarray]],
    with_nextn: bool,
    seed: int,
    variant: str,
    *,
    name: str | None = None,
    tokenizer_pre: str = "default",
    file_type: gguf.LlamaFileType = gguf.LlamaFileType.ALL_F32,
    tensor_types: Mapping[str, gguf.GGMLQuantizationType] | None = None,
    extra_kv: Mapping[str, str] | None = None,
    chat_template: str | None = None,
) -> None:
    """Write one ``step35`` GGUF.

    The keyword-only arguments are for models other than the tiny test ones (the
    defaults write exactly what the tests expect): ``name`` replaces the
    ``general.name``, ``tokenizer_pre`` the pre-tokenizer, ``file_type`` the
    declared ``general.file_type``; ``tensor_types`` maps tensor names to a
    ggml type to store them as (F32 / F16 / Q8_0, quantized here with
    ``gguf.quants``; absent names stay as given); ``extra_kv`` adds string keys.
    """
    n_blocks = cfg.n_layer_all if with_nextn else cfg.n_layer
    w = gguf.GGUFWriter(str(path), ARCH)

    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(name if name is not None else f"stepmtp tiny step35 ({variant}, seed {seed})")
    w.add_block_count(n_blocks)
    w.add_context_length(cfg.n_ctx_train)
    w.add_embedding_length(cfg.n_embd)
    w.add_feed_forward_length(cfg.n_ff)
    # per-layer arrays of length block_count, MTP blocks included: llama.cpp reads
    # them before it knows nextn_predict_layers, so a shorter array fails to load
    w.add_head_count([cfg.n_head(il) for il in range(n_blocks)])
    w.add_head_count_kv([cfg.n_head_kv] * n_blocks)
    w.add_rope_freq_base(cfg.rope_freq_base)
    w.add_rope_freq_base_swa(cfg.rope_freq_base_swa)
    w.add_layer_norm_rms_eps(cfg.rms_eps)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_file_type(file_type)
    w.add_sliding_window(cfg.n_swa)
    w.add_sliding_window_pattern(cfg.swa_pattern(n_blocks))
    w.add_expert_count(cfg.n_expert)
    w.add_expert_used_count(cfg.n_expert_used)
    w.add_expert_feed_forward_length(cfg.n_ff_exp)
    w.add_expert_shared_feed_forward_length(cfg.n_ff_shexp)
    w.add_expert_weights_scale(cfg.expert_weights_scale)
    w.add_expert_weights_norm(cfg.expert_weights_norm)
    w.add_leading_dense_block_count(cfg.n_leading_dense)
    w.add_moe_every_n_layers(1)
    w.add_swiglu_clamp_exp(cfg.swiglu_clamp_exp(n_blocks))
    w.add_swiglu_clamp_shexp(cfg.swiglu_clamp_shexp(n_blocks))
    if with_nextn:
        w.add_nextn_predict_layers(cfg.n_nextn)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(tokenizer_pre)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.token_types)
    w.add_token_merges(vocab.merges)
    w.add_bos_token_id(cfg.bos_id)
    w.add_eos_token_id(cfg.eos_id)
    w.add_pad_token_id(cfg.pad_id)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template(chat_template or CHAT_TEMPLATE)
    for key, value in (extra_kv or {}).items():
        w.add_string(key, value)

    for tname, arr in tensors:
        qtype = (tensor_types or {}).get(tname)
        if qtype is None:
            w.add_tensor(tname, arr)
        elif qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(tname, np.ascontiguousarray(arr, dtype=np.float32))
        elif qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(tname, np.ascontiguousarray(arr, dtype=np.float16))
        else:
            data = gguf.quants.quantize(np.ascontiguousarray(arr, dtype=np.float32), qtype)
            w.add_tensor(tname, data, raw_dtype=qtype)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_tiny_models(out_dir: str | Path, seed: int = 0, cfg: TinyConfig = CONFIG) -> dict[str, Path]:
    """Write every variant of :data:`VARIANT_FILES` into ``out_dir``.

    Returns ``{variant: path}``.  Output is byte-for-byte identical for the
    same ``seed`` (and config); existing files are overwritten.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab = build_vocab(cfg)
    tensors = make_tensors(cfg, seed)
    paths: dict[str, Path] = {}
    for variant, fname in VARIANT_FILES.items():
        path = out / fname
        _write_gguf(
            path,
            cfg,
            vocab,
            _select(tensors, cfg, variant),
            with_nextn=variant != "nomtp",
            seed=seed,
            variant=variant,
        )
        paths[variant] = path
    return paths


# ---------------------------------------------------------------------------
# adapters for the tiny model (llama-server's --lora, --control-vector)
# ---------------------------------------------------------------------------

#: the tensors ``write_tiny_lora`` adapts by default: attention and the output of the
#: trunk, and a dense FFN (2-D weights; the experts' 3-D ones take no plain pair)
LORA_TARGETS = ("blk.1.attn_q.weight", "blk.2.attn_output.weight", "blk.0.ffn_up.weight", "output.weight")


def write_tiny_lora(path: str | Path, cfg: TinyConfig = CONFIG, seed: int = 1, *, rank: int = 4,
                    alpha: float = 8.0, gain: float = 1.0, targets: Sequence[str] = LORA_TARGETS,
                    arch: str = ARCH) -> Path:
    """A LoRA adapter GGUF for the tiny model, as llama.cpp's converter writes one:
    ``general.type = adapter``, ``adapter.type = lora``, ``adapter.lora.alpha``, and for
    each adapted tensor ``<name>.lora_a`` (ggml {n_in, rank}) and ``<name>.lora_b``
    ({rank, n_out}); the product B A is added to the weight, times scale * alpha / rank.
    ``gain`` scales B (the adapter's strength); ``arch``: another architecture makes a
    file llama.cpp refuses for this model."""
    shapes = {name: arr.shape for name, arr in make_tensors(cfg, seed=0).items()}
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    for name in targets:
        n_out, n_in = shapes[name]
        a = rng.standard_normal((rank, n_in)) / math.sqrt(n_in)
        b = rng.standard_normal((n_out, rank)) * (gain / math.sqrt(rank))
        w.add_tensor(name + ".lora_a", a.astype(np.float32))
        w.add_tensor(name + ".lora_b", b.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def write_tiny_control_vector(path: str | Path, cfg: TinyConfig = CONFIG, seed: int = 2, *,
                              layers: Sequence[int] = (1, 2, 3), gain: float = 1.0) -> Path:
    """A control vector GGUF for the tiny model, as llama.cpp's cvector-generator writes
    one: a one-dimensional F32 ``direction.<layer>`` of n_embd values per layer (1 or
    more: llama.cpp adds them after those layers)."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "controlvector")
    w.add_string("controlvector.model_hint", ARCH)
    w.add_uint32("controlvector.layer_count", len(layers))
    for il in layers:
        w.add_tensor(f"direction.{il}", (gain * rng.standard_normal(cfg.n_embd)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


# ---------------------------------------------------------------------------
# a model whose drafts are (partly) right
# ---------------------------------------------------------------------------

#: File name written by :func:`write_agree_model`.
AGREE_FILE = "tiny-agree.gguf"


@dataclass(frozen=True)
class AgreeMaps:
    """Token maps a :func:`write_agree_model` file implements (numpy int arrays of length n_vocab).

    ``trunk[t]`` is the trunk's greedy next token after ``t``; ``heads[k][t]`` is
    MTP head ``k``'s argmax when it is fed token ``t``.  Head ``k`` agrees with the
    trunk exactly on the tokens where ``heads[k][t] == trunk[t]``.
    """

    trunk: np.ndarray
    heads: tuple[np.ndarray, ...]


def make_agree_tensors(
    cfg: TinyConfig = CONFIG,
    seed: int = 0,
    agree: Sequence[float] = (0.9, 0.7, 0.5),
    leak: float = 0.05,
) -> tuple[dict[str, np.ndarray], AgreeMaps]:
    """Weights of a near-bigram model whose MTP heads predict the trunk's next-next token.

    With random weights (:func:`make_tensors`) the heads never agree with the
    trunk, so a speculative decoder only ever rejects.  Here the residual stream
    is dominated by the current token's embedding (every block's output
    projections are scaled by ``leak``), the trunk's head maps token ``t`` to
    ``f(t)`` for a fixed random permutation ``f``, and MTP head ``k`` reads
    mostly its input token and maps it to ``f(t)`` on a random ``agree[k]``
    fraction of the vocabulary (to a different token elsewhere).  Chained
    greedy drafting then accepts a deterministic, partial number of tokens.
    Every block, gate, expert and norm still runs, only with small weight.
    """
    if len(agree) != cfg.n_nextn:
        raise ValueError(f"need one agree fraction per MTP head ({cfg.n_nextn})")
    t = make_tensors(cfg, seed)
    rng = np.random.default_rng([seed, 0xA9EE])
    V, E = cfg.n_vocab, cfg.n_embd
    n_normal = V - len(cfg.special_tokens)

    # trunk map: a permutation of the normal tokens; specials go to normal tokens too,
    # so greedy decoding never emits a control token (and never stops early)
    f = np.empty(V, dtype=np.int64)
    f[:n_normal] = rng.permutation(n_normal)
    f[n_normal:] = rng.integers(0, n_normal, V - n_normal)

    def head_rows(fmap: np.ndarray, gain: float) -> np.ndarray:
        # row j = sum of the (unit) embeddings of the tokens mapped to j, so that
        # logits_j ~ <e_j-sources, e_t>: largest for j = fmap[t] since random
        # 64-d embeddings are nearly orthogonal (self 1.0 vs others ~0.12)
        emb = t["token_embd.weight"].astype(np.float64)
        unit = emb / np.linalg.norm(emb, axis=1, keepdims=True)
        rows = np.zeros((V, E))
        np.add.at(rows, fmap, unit)
        return (gain * rows + 0.01 * rng.standard_normal((V, E))).astype(np.float32)

    for name in list(t):
        if name.endswith(("attn_output.weight", "ffn_down.weight", "ffn_down_exps.weight", "ffn_down_shexp.weight")):
            t[name] = (t[name] * leak).astype(np.float32)

    t["output_norm.weight"] = np.ones(E, dtype=np.float32)
    t["output.weight"] = head_rows(f, 10.0)

    heads = []
    for k, frac in enumerate(agree):
        il = cfg.n_layer + k
        p = f"blk.{il}."
        fk = f.copy()
        wrong = rng.random(V) >= frac
        # a different normal token on the disagreeing inputs
        fk[wrong] = (f[wrong] + 1 + rng.integers(0, n_normal - 1, int(wrong.sum()))) % n_normal
        heads.append(fk)
        eh = (leak * rng.standard_normal((E, 2 * E)) / math.sqrt(2 * E)).astype(np.float32)
        eh[:, :E] += np.eye(E, dtype=np.float32)  # x ~ enorm(embed(token)): the token decides
        t[p + "nextn.eh_proj.weight"] = eh
        t[p + "nextn.enorm.weight"] = np.ones(E, dtype=np.float32)
        t[p + "nextn.shared_head_norm.weight"] = np.ones(E, dtype=np.float32)
        t[p + "nextn.shared_head_head.weight"] = head_rows(fk, 10.0)

    return t, AgreeMaps(trunk=f, heads=tuple(heads))


def write_agree_model(
    out_dir: str | Path,
    seed: int = 0,
    agree: Sequence[float] = (0.9, 0.7, 0.5),
    cfg: TinyConfig = CONFIG,
) -> tuple[Path, AgreeMaps]:
    """Write ``tiny-agree.gguf`` (trunk + 3 MTP blocks in one file), see :func:`make_agree_tensors`.

    Returns the path and the token maps it implements, so a test can predict
    exactly which drafts the trunk accepts.  Deterministic for a given seed and
    ``agree``; the weights are *not* those of :func:`write_tiny_models`.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors, maps = make_agree_tensors(cfg, seed, agree)
    path = out / AGREE_FILE
    _write_gguf(path, cfg, build_vocab(cfg), tensors.items(), with_nextn=True, seed=seed, variant="agree")
    return path, maps


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m stepmtp.tiny", description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path, help="output directory")
    ap.add_argument("--seed", type=int, default=0, help="numpy default_rng seed (default 0)")
    ap.add_argument("--agree", action="store_true", help=f"also write {AGREE_FILE} (drafts partly accepted)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    paths = write_tiny_models(args.out, seed=args.seed)
    if args.agree:
        paths["agree"] = write_agree_model(args.out, seed=args.seed)[0]
    dt = time.perf_counter() - t0
    for variant, path in paths.items():
        print(f"{variant:9s} {path} ({path.stat().st_size} bytes)")
    print(f"wrote {len(paths)} files in {dt:.2f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
