"""Numpy reference of the Step-3.5 (``step35``) trunk and MTP-block forward passes.

This mirrors, op by op, the ggml graphs in llama.cpp's ``src/models/step35.cpp``
(``graph`` for the trunk, ``graph_mtp`` for one MTP block) for a *fresh* KV
cache: all ``n`` rows form one causal batch at the given positions.  It reads
the weights of any ``step35`` GGUF with ``gguf.GGUFReader`` (F32/F16/BF16
tensors only, which is what :mod:`stepmtp.tiny` writes) and computes in
float64, so it is a clean ground truth to compare llama.cpp's float32 output
against (expect ~1e-5 relative agreement at small positions).

Semantics matched on purpose (see the notes in each function):

* RMSNorm is ``x / sqrt(mean(x^2) + eps) * w``; q/k norms are per head.
* RoPE is NEOX style (pairs ``i`` and ``i + n_rot/2``) over the first ``n_rot``
  dims only: ``n_rot = head_dim / 2`` on full-attention layers,
  ``head_dim`` on sliding-window layers.  Full layers use
  ``rope.freq_base`` and divide the angle by ``rope_freqs.weight``; SWA layers
  use ``rope.freq_base_swa`` and no factors.  Angles are formed in float32 the
  way ggml does (``theta_i = pos * theta_scale**i`` by repeated multiply).
* Attention: GQA with query head ``h`` reading kv head ``h // (n_head/n_head_kv)``,
  scale ``1/sqrt(head_dim)``, key visible iff ``k_pos <= q_pos`` and, on SWA
  layers, ``q_pos - k_pos < n_swa``; then a per-head ``sigmoid(attn_gate @ x)``.
* SwiGLU with the Step-3.5 clamp when the layer's limit is > 1e-6:
  ``min(silu(gate), L) * clip(up, -L, L)`` (``swiglu_clamp_exp`` for routed
  experts, ``swiglu_clamp_shexp`` for the shared expert *and* dense MLPs).
* MoE: sigmoid router probs, top-k chosen on ``probs + exp_probs_b`` but
  weighted by the unbiased probs, normalised (sum clamped to >= 6.1035e-5) if
  ``expert_weights_norm``, times ``expert_weights_scale``, plus the shared expert.

Public API: :func:`mtp_block_forward`, :func:`trunk_forward`, :func:`load_model`,
:func:`trunk_greedy`.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import gguf

ARCH = "step35"


# ---------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------


@dataclass
class StepModel:
    """Weights (float64, numpy row-major ``(n_out, n_in)``) plus llama.cpp's view of the hparams."""

    path: Path
    tensors: dict[str, np.ndarray]
    n_embd: int
    n_vocab: int
    n_layer_all: int          # step35.block_count
    n_layer: int              # trunk blocks = n_layer_all - n_nextn
    n_nextn: int
    n_head: list[int]         # per block
    n_head_kv: list[int]      # per block
    head_dim_k: int
    head_dim_v: int
    is_swa: list[bool]        # per block
    n_rot: list[int]          # per block
    n_swa: int
    rope_base: float
    rope_base_swa: float
    rms_eps: float
    n_expert: int
    n_expert_used: int
    gating_func: int          # 1 softmax, 2 sigmoid (llama.cpp's enum)
    weights_norm: bool
    weights_scale: float
    clamp_exp: list[float]    # per block
    clamp_shexp: list[float]  # per block

    def get(self, name: str) -> np.ndarray | None:
        return self.tensors.get(name)

    def w(self, name: str) -> np.ndarray:
        t = self.tensors.get(name)
        if t is None:
            raise KeyError(f"{self.path}: missing tensor {name}")
        return t


def _field(reader: gguf.GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _per_layer(value, n: int, default) -> list:
    """llama.cpp's get_key_or_arr: a scalar is broadcast, an array must have length n."""
    if value is None:
        return [default] * n
    if isinstance(value, list):
        if len(value) != n:
            raise ValueError(f"per-layer array has length {len(value)}, expected {n}")
        return list(value)
    return [value] * n


def _load(path: Path) -> StepModel:
    reader = gguf.GGUFReader(str(path))
    arch = _field(reader, "general.architecture")
    if arch != ARCH:
        raise ValueError(f"{path}: architecture {arch!r}, expected {ARCH!r}")
    k = lambda name: f"{ARCH}.{name}"  # noqa: E731

    tensors: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        if t.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            if t.tensor_type == gguf.GGMLQuantizationType.BF16:
                raw = np.asarray(t.data).view(np.uint16).astype(np.uint32) << 16
                arr = raw.view(np.float32)
            else:
                raise ValueError(f"{path}: tensor {t.name} has unsupported type {t.tensor_type.name}")
        else:
            arr = np.asarray(t.data)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        tensors[t.name] = arr.reshape(shape).astype(np.float64)

    n_layer_all = int(_field(reader, k("block_count")))
    n_nextn = int(_field(reader, k("nextn_predict_layers"), 0))
    n_embd = int(_field(reader, k("embedding_length")))
    n_vocab = len(_field(reader, "tokenizer.ggml.tokens"))

    # per-layer arrays are read with n = block_count (before nextn is known)
    n_head = [int(v) for v in _per_layer(_field(reader, k("attention.head_count")), n_layer_all, None)]
    n_head_kv = [int(v) for v in _per_layer(_field(reader, k("attention.head_count_kv")), n_layer_all, None)]
    n_head_kv = [kv if kv is not None else h for kv, h in zip(n_head_kv, n_head)]
    hd_k = int(_field(reader, k("attention.key_length"), n_embd // n_head[0]))
    hd_v = int(_field(reader, k("attention.value_length"), n_embd // n_head[0]))
    is_swa = [bool(v) for v in _per_layer(_field(reader, k("attention.sliding_window_pattern")), n_layer_all, False)]

    # llama-model.cpp: n_rot_full defaults to head_dim_k, n_rot_swa to that same
    # value; step35's load_arch_hparams then halves n_rot_full (partial rotary 0.5)
    n_rot_full = int(_field(reader, k("rope.dimension_count"), hd_k))
    n_rot_swa = int(_field(reader, k("rope.dimension_count_swa"), n_rot_full))
    n_rot_full //= 2
    n_rot = [n_rot_swa if s else n_rot_full for s in is_swa]

    gating = int(_field(reader, k("expert_gating_func"), 0)) or 2  # step35 defaults to sigmoid

    return StepModel(
        path=path,
        tensors=tensors,
        n_embd=n_embd,
        n_vocab=n_vocab,
        n_layer_all=n_layer_all,
        n_layer=n_layer_all - n_nextn,
        n_nextn=n_nextn,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim_k=hd_k,
        head_dim_v=hd_v,
        is_swa=is_swa,
        n_rot=n_rot,
        n_swa=int(_field(reader, k("attention.sliding_window"))),
        rope_base=float(_field(reader, k("rope.freq_base"), 10000.0)),
        rope_base_swa=float(_field(reader, k("rope.freq_base_swa"), 10000.0)),
        rms_eps=float(_field(reader, k("attention.layer_norm_rms_epsilon"))),
        n_expert=int(_field(reader, k("expert_count"), 0)),
        n_expert_used=int(_field(reader, k("expert_used_count"), 0)),
        gating_func=gating,
        weights_norm=bool(_field(reader, k("expert_weights_norm"), False)),
        weights_scale=float(_field(reader, k("expert_weights_scale"), 0.0)),
        clamp_exp=[float(v) for v in _per_layer(_field(reader, k("swiglu_clamp_exp")), n_layer_all, 0.0)],
        clamp_shexp=[float(v) for v in _per_layer(_field(reader, k("swiglu_clamp_shexp")), n_layer_all, 0.0)],
    )


@functools.lru_cache(maxsize=16)
def _load_cached(path: str, mtime_ns: int, size: int) -> StepModel:
    del mtime_ns, size  # cache key only: a rewritten file is reloaded
    return _load(Path(path))


def load_model(gguf_path: str | os.PathLike) -> StepModel:
    """Load (and cache) the weights and hparams of a ``step35`` GGUF."""
    p = Path(gguf_path).resolve()
    st = p.stat()
    return _load_cached(str(p), st.st_mtime_ns, st.st_size)


# ---------------------------------------------------------------------------
# ops
# ---------------------------------------------------------------------------


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis (ggml_rms_norm followed by ggml_mul)."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def swiglu(g: np.ndarray, u: np.ndarray, limit: float) -> np.ndarray:
    """silu(g) * u, with Step-3.5's clamp when ``limit`` > 1e-6 (llama-graph.cpp)."""
    a = silu(g)
    if limit > 1e-6:
        a = np.minimum(a, limit)
        u = np.clip(u, -limit, limit)
    return a * u


def rope_neox(x: np.ndarray, pos: np.ndarray, n_rot: int, base: float, factors: np.ndarray | None) -> np.ndarray:
    """NEOX RoPE of ``x`` [n, H, hd] over its first ``n_rot`` dims.

    ggml builds the angle cache in float32: ``theta_scale = powf(base, -2/n_rot)``,
    ``theta_0 = pos`` and ``theta_{i+1} = theta_i * theta_scale``, then uses
    ``theta_i / freq_factor[i]``; replicating that keeps the reference within
    float32 rounding of llama.cpp even at large positions.
    """
    half = n_rot // 2
    theta_scale = np.float32(np.power(np.float32(base), np.float32(-2.0 / n_rot), dtype=np.float32))
    theta = np.empty((len(pos), half), dtype=np.float32)
    cur = np.asarray(pos, dtype=np.float32)
    for i in range(half):
        ff = np.float32(1.0) if factors is None else np.float32(factors[i])
        theta[:, i] = cur / ff
        cur = (cur * theta_scale).astype(np.float32)
    cos = np.cos(theta.astype(np.float64))[:, None, :]
    sin = np.sin(theta.astype(np.float64))[:, None, :]
    out = x.copy()
    x0 = x[..., :half]
    x1 = x[..., half:n_rot]
    out[..., :half] = x0 * cos - x1 * sin
    out[..., half:n_rot] = x0 * sin + x1 * cos
    return out


def _attention_block(m: StepModel, il: int, x_norm: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Self-attention of block ``il`` (after attn_norm) up to and including wo."""
    n = x_norm.shape[0]
    p = f"blk.{il}."
    H, Hkv, dk, dv = m.n_head[il], m.n_head_kv[il], m.head_dim_k, m.head_dim_v

    q = (x_norm @ m.w(p + "attn_q.weight").T).reshape(n, H, dk)
    k = (x_norm @ m.w(p + "attn_k.weight").T).reshape(n, Hkv, dk)
    v = (x_norm @ m.w(p + "attn_v.weight").T).reshape(n, Hkv, dv)
    if (qn := m.get(p + "attn_q_norm.weight")) is not None:
        q = rms_norm(q, qn, m.rms_eps)
    if (kn := m.get(p + "attn_k_norm.weight")) is not None:
        k = rms_norm(k, kn, m.rms_eps)

    swa = m.is_swa[il]
    base = m.rope_base_swa if swa else m.rope_base
    # rope factors only on full-attention layers (step35.cpp passes nullptr on SWA)
    factors = None if swa else m.get("rope_freqs.weight")
    q = rope_neox(q, positions, m.n_rot[il], base, factors)
    k = rope_neox(k, positions, m.n_rot[il], base, factors)

    qp = positions[:, None]
    kp = positions[None, :]
    visible = kp <= qp
    if swa:
        visible &= (qp - kp) < m.n_swa

    group = H // Hkv
    scale = 1.0 / np.sqrt(dk)
    out = np.empty((n, H, dv))
    for h in range(H):
        s = (q[:, h, :] @ k[:, h // group, :].T) * scale
        s = np.where(visible, s, -np.inf)
        s = s - s.max(axis=1, keepdims=True)
        pr = np.exp(s)
        pr /= pr.sum(axis=1, keepdims=True)
        out[:, h, :] = pr @ v[:, h // group, :]

    if (g := m.get(p + "attn_gate.weight")) is not None:
        out = out * sigmoid(x_norm @ g.T)[:, :, None]

    return out.reshape(n, H * dv) @ m.w(p + "attn_output.weight").T


def _dense_ffn(m: StepModel, il: int, x: np.ndarray, suffix: str = "") -> np.ndarray:
    """build_ffn(SILU, PAR) with the shexp clamp: used for dense MLPs and the shared expert."""
    p = f"blk.{il}."
    g = x @ m.w(p + f"ffn_gate{suffix}.weight").T
    u = x @ m.w(p + f"ffn_up{suffix}.weight").T
    return swiglu(g, u, m.clamp_shexp[il]) @ m.w(p + f"ffn_down{suffix}.weight").T


def _moe_ffn(m: StepModel, il: int, x: np.ndarray) -> np.ndarray:
    """build_moe_ffn for step35, plus the shared expert."""
    p = f"blk.{il}."
    logits = x @ m.w(p + "ffn_gate_inp.weight").T  # [n, n_expert]
    if m.gating_func == 1:
        e = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs = e / e.sum(axis=1, keepdims=True)
    elif m.gating_func == 2:
        probs = sigmoid(logits)
    else:
        raise NotImplementedError(f"expert gating func {m.gating_func}")
    sel = probs
    if (b := m.get(p + "exp_probs_b.bias")) is not None:
        sel = probs + b  # selection only; the weights below use unbiased probs

    gate_e = m.w(p + "ffn_gate_exps.weight")  # [X, F, E]
    up_e = m.w(p + "ffn_up_exps.weight")      # [X, F, E]
    down_e = m.w(p + "ffn_down_exps.weight")  # [X, E, F]

    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        top = np.argsort(-sel[t], kind="stable")[: m.n_expert_used]
        wts = probs[t, top]
        if m.weights_norm:
            wts = wts / max(wts.sum(), 6.103515625e-5)
        if m.weights_scale != 0.0 and m.weights_scale != 1.0:
            wts = wts * m.weights_scale
        for e_id, wt in zip(top, wts):
            h = swiglu(gate_e[e_id] @ x[t], up_e[e_id] @ x[t], m.clamp_exp[il])
            out[t] += wt * (down_e[e_id] @ h)

    return out + _dense_ffn(m, il, x, "_shexp")


def _decoder_layer(m: StepModel, il: int, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
    p = f"blk.{il}."
    cur = rms_norm(x, m.w(p + "attn_norm.weight"), m.rms_eps)
    ffn_inp = _attention_block(m, il, cur, positions) + x
    cur = rms_norm(ffn_inp, m.w(p + "ffn_norm.weight"), m.rms_eps)
    if m.get(p + "ffn_gate_inp.weight") is None:
        cur = _dense_ffn(m, il, cur)
    else:
        cur = _moe_ffn(m, il, cur)
    return cur + ffn_inp


def _check_inputs(m: StepModel, tokens, positions) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
    n = tokens.shape[0]
    positions = np.arange(n, dtype=np.int64) if positions is None else np.asarray(positions, dtype=np.int64).reshape(-1)
    if positions.shape[0] != n:
        raise ValueError(f"{n} tokens but {positions.shape[0]} positions")
    if n and (tokens.min() < 0 or tokens.max() >= m.n_vocab):
        raise ValueError("token id out of range")
    return tokens, positions


# ---------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------


def mtp_block_forward(
    gguf_path: str | os.PathLike,
    block: int,
    tokens: np.ndarray,
    h_in: np.ndarray,
    positions: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """One MTP block (``blk.{n_layer + block}``) forward, as ``graph_mtp`` computes it.

    Args:
        gguf_path: any ``step35`` GGUF that holds that block (embedded or MTP-only).
        block: MTP block number, 0-based (0 is the block right after the trunk).
        tokens: ``[n]`` token ids fed to the block (the "next" tokens).
        h_in: ``[n, n_embd]`` hidden states fed to the block (the trunk's or the
            previous block's ``h_nextn``, i.e. *before* any output norm).
        positions: ``[n]`` positions (default ``0..n-1``); rows attend to each other
            causally by position, with no other KV.

    Returns:
        ``(hidden_out [n, n_embd], logits [n, n_vocab])``: ``hidden_out`` is the
        block's ``h_nextn`` (post-FFN residual, before the head norm) and ``logits``
        are ``head @ rmsnorm(hidden_out) * head_norm`` with the block's
        ``nextn.shared_head_*`` (falling back to ``output_norm`` / ``output``).
    """
    m = load_model(gguf_path)
    if not 0 <= block < m.n_nextn:
        raise ValueError(f"block {block} out of range: model has {m.n_nextn} MTP blocks")
    il = m.n_layer + block
    p = f"blk.{il}."
    tokens, positions = _check_inputs(m, tokens, positions)
    h_in = np.asarray(h_in, dtype=np.float64).reshape(tokens.shape[0], m.n_embd)

    embd_w = m.get(p + "nextn.embed_tokens.weight")
    if embd_w is None:
        embd_w = m.w("token_embd.weight")
    e = rms_norm(embd_w[tokens], m.w(p + "nextn.enorm.weight"), m.rms_eps)
    h = rms_norm(h_in, m.w(p + "nextn.hnorm.weight"), m.rms_eps)
    # ggml_concat(e_norm, h_norm, dim 0): embedding first, then hidden state
    x = np.concatenate([e, h], axis=1) @ m.w(p + "nextn.eh_proj.weight").T

    hidden = _decoder_layer(m, il, x, positions)

    head_norm = m.get(p + "nextn.shared_head_norm.weight")
    if head_norm is None:
        head_norm = m.w("output_norm.weight")
    head = m.get(p + "nextn.shared_head_head.weight")
    if head is None:
        head = m.w("output.weight")
    logits = rms_norm(hidden, head_norm, m.rms_eps) @ head.T
    return hidden, logits


def trunk_forward(
    gguf_path: str | os.PathLike,
    tokens: np.ndarray,
    positions: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Trunk forward (``graph`` in step35.cpp) for one fresh causal batch.

    Returns ``(h_nextn [n, n_embd], logits [n, n_vocab])``; ``h_nextn`` is the
    output of the last trunk block before ``output_norm`` -- what the first MTP
    block takes as ``h_in``.
    """
    m = load_model(gguf_path)
    tokens, positions = _check_inputs(m, tokens, positions)
    x = m.w("token_embd.weight")[tokens]
    for il in range(m.n_layer):
        x = _decoder_layer(m, il, x, positions)
    logits = rms_norm(x, m.w("output_norm.weight"), m.rms_eps) @ m.w("output.weight").T
    return x, logits


def trunk_greedy(gguf_path: str | os.PathLike, prompt: np.ndarray, n_predict: int) -> list[int]:
    """Greedy continuation of ``prompt`` by the trunk alone (recomputed each step; tiny models only)."""
    toks = [int(t) for t in np.asarray(prompt).reshape(-1)]
    out: list[int] = []
    for _ in range(n_predict):
        _, logits = trunk_forward(gguf_path, np.asarray(toks))
        nxt = int(np.argmax(logits[-1]))
        out.append(nxt)
        toks.append(nxt)
    return out
