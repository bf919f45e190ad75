"""Give a small ``step35`` GGUF Step-3.5-Flash's cost shape, keeping its predictions.

On a bench model speculative decoding pays off only as much as its costs allow: how
much one head decode costs next to a target decode, and how much a k-row verify costs
next to a 1-row decode. Step-3.5-Flash has 45 trunk layers and one layer per head, a
128k-vocabulary output head, and 288 routed experts of which each row uses 8, so k
verified rows read about k times the routed experts one row does. ``shape_like_flash``
writes a variant of a trained model (the bundled one) with those proportions:

* **layers**: identity layers are appended to the trunk up to Step-3.5-Flash's 45:
  zero attention output and zero expert / shared-expert down projections, so the
  residual passes through unchanged (their routers are random, so that rows spread
  over the experts as a real router does, and the zero experts cost what real ones do);
* **width**: every weight matrix of Step-3.5-Flash has one side of the hidden width
  (4096); the bench model keeps that side at the trained width, or (``hidden``) at a
  power of 4 times it with zero channels, and makes every other side ``scale`` times
  Step-3.5-Flash's (query/key/value heads, dense and expert FFN widths, vocabulary), so
  that bytes are spread over trunk layers, heads, output head and experts as in
  Step-3.5-Flash, and ``scale`` sets how many bytes one decode reads. The wider hidden
  state is what makes a CPU decode weight-bound as a GPU's is: at 128 each row's dot
  products are 128 long and their fixed cost, paid again for each verified row, and
  attention (as many query heads as Step-3.5-Flash's over a state 32x narrower) weigh
  as much as reading the weights;
* **head width** (``head_dim_new``): the trained 32-wide heads padded with zero
  channels to Step-3.5-Flash's 128 (fewer heads, as many query bytes), the query norm
  scaled so that every score stays what it was, the trained
  rotary width kept. A CPU's attention costs per head and cached cell; at 32 wide those
  fixed costs, not the arithmetic, made attention a third of a decode, paid again for
  every verified row. What does not follow: the key/value heads stay the trained two
  (Step-3.5-Flash's eight, scaled, would be half of one), so their weights and cache are
  4x Step-3.5-Flash's share;
* **type** (``f16``): Q8_0 matrices written as F16, which a CPU core multiplies at
  nearly the speed it reads them (Q8_0 at about a quarter of that);
* **heads**: each MTP block is a decoder layer with Step-3.5-Flash's scaled widths,
  so a head's block costs what one trunk layer does, as in Step-3.5-Flash;
* **output head**: the vocabulary is padded to ``scale`` x 128,896 with unused tokens
  whose output rows (the trunk's and every head's) are the mean of the real rows: a
  padded token's logit is the mean of the real logits, below the largest one, so it
  is never the greedy choice (nor in the top 10 a draft is picked from, nor in the
  default sampler's top-k 40 / min-p 0.05);
* **experts**: the trained model's top-k is kept and the expert count set to top-k x
  288 / 8, so that k rows touch the same share of experts as in Step-3.5-Flash; the
  added experts of the trained layers have a selection bias of -1e9 and are never
  routed to, and every expert is as wide as 8/top-k of Step-3.5-Flash's (scaled), so
  the experts one row uses are as many bytes as Step-3.5-Flash's 8.

Added channels, heads and experts are zero (a zero block is zero in every ggml type),
placed so that each original dot product adds the same terms in the same order, and
original heads keep their key/value head, so the greedy tokens are the trained
model's (tested; with ``hidden`` and ``f16`` up to rounding and a norm epsilon, see
:func:`_widen_hidden`). What cannot follow: the hidden width's size itself (so
``eh_proj``, 2 hidden x hidden in Step-3.5-Flash, stays small), the trained layers'
attention kinds and dense layer count (1 here, 3 there).

    python -m stepmtp.bench.flash SRC.gguf DST.gguf --scale 0.0625 --hidden 512 --head-dim 128 --f16
    python -m stepmtp.bench.flash --estimate      # the cost ratios of Step-3.5-Flash
    python -m stepmtp.bench.flash --measure DST.gguf   # the same ratios, timed
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

__all__ = ["FLASH", "FlashConfig", "ShapeResult", "shape_like_flash", "scale_for_mb", "estimate_costs",
           "decode_params", "measure_costs", "PAD_TOKEN"]


@dataclass(frozen=True)
class FlashConfig:
    """Step-3.5-Flash's published text configuration (``config.json`` of
    stepfun-ai/Step-3.5-Flash, as quoted by several open inference projects):
    layer i is full attention when i % 4 == 0, else sliding-window with more query heads
    (``attention_other_setting``); layers 0-2 dense, 3-44 MoE; 3 MTP layers."""

    hidden: int = 4096
    n_layer: int = 45
    n_mtp: int = 3
    vocab: int = 128896
    head_dim: int = 128
    n_head_full: int = 64
    n_head_swa: int = 96
    n_kv: int = 8
    dense_ff: int = 11264
    n_dense: int = 3
    n_expert: int = 288
    top_k: int = 8
    expert_ff: int = 1280
    shexp_ff: int = 1280

    def is_full(self, il: int) -> bool:
        return il % 4 == 0

    def n_head(self, il: int) -> int:
        return self.n_head_full if self.is_full(il) else self.n_head_swa


FLASH = FlashConfig()

#: Text of the padded tokens (type UNUSED), ``{}`` their index.
PAD_TOKEN = "[bench-pad-{}]"

#: Selection bias of the experts added to trained MoE layers: never in any top-k.
NEVER_ROUTED = -1.0e9

#: Bytes per parameter of Q8_0 (the bundled model's type): 34 bytes per 32.
Q8_0_BYTES = 34 / 32


def _attn_params(cfg: FlashConfig, il: int, d: int | None = None) -> int:
    d = cfg.hidden if d is None else d
    q = cfg.n_head(il) * cfg.head_dim
    kv = cfg.n_kv * cfg.head_dim
    return d * q * 2 + d * kv * 2 + d * cfg.n_head(il)  # q, o; k, v; head-wise gate


def decode_params(cfg: FlashConfig = FLASH) -> dict[str, Any]:
    """Weights one decode reads, in parameters, from ``cfg`` (norms left out: < 0.01%).

    ``target(k)``: a k-row target decode, with the expected number of distinct routed
    experts k rows use when each row picks ``top_k`` of ``n_expert`` uniformly and
    independently: n_expert * (1 - (1 - top_k / n_expert) ** k) (an upper bound: real
    rows that follow each other share more experts)."""
    d = cfg.hidden
    attn = sum(_attn_params(cfg, il) for il in range(cfg.n_layer))
    dense = 3 * d * cfg.dense_ff
    expert = 3 * d * cfg.expert_ff
    shexp = 3 * d * cfg.shexp_ff
    router = d * cfg.n_expert
    n_moe = cfg.n_layer - cfg.n_dense
    out = d * cfg.vocab
    fixed = attn + cfg.n_dense * dense + n_moe * (shexp + router) + out

    def distinct(k: int) -> float:
        return cfg.n_expert * (1 - (1 - cfg.top_k / cfg.n_expert) ** k)

    head_il = cfg.n_layer  # the first MTP layer's attention kind
    head = 2 * d * d + _attn_params(cfg, head_il) + dense + out
    return {
        "attention": attn, "dense_ffn": cfg.n_dense * dense, "routed_expert": expert, "n_moe": n_moe,
        "shared_expert+router": n_moe * (shexp + router), "output": out, "fixed": fixed,
        "distinct": {k: distinct(k) for k in (1, 2, 3, 4)},
        "target": {k: fixed + n_moe * expert * distinct(k) for k in (1, 2, 3, 4)},
        "head_block": 2 * d * d + _attn_params(cfg, head_il) + dense, "head": head,
    }


def estimate_costs(cfg: FlashConfig = FLASH) -> tuple[dict[str, float], str]:
    """Step-3.5-Flash's cost ratios, memory-bound (time = weight bytes read, one
    precision throughout), and the arithmetic as text."""
    p = decode_params(cfg)
    G = 1e9
    t1 = p["target"][1]
    lines = [
        f"Step-3.5-Flash ({cfg.hidden} hidden, {cfg.n_layer} layers, {cfg.n_expert} experts top-{cfg.top_k}, "
        f"vocab {cfg.vocab}), weights read per decode, in parameters:",
        f"  attention, {cfg.n_layer} layers (q,o {cfg.hidden}x{cfg.n_head_full}*{cfg.head_dim} full / "
        f"x{cfg.n_head_swa}*{cfg.head_dim} SWA; k,v {cfg.hidden}x{cfg.n_kv}*{cfg.head_dim}): {p['attention'] / G:.3f} G",
        f"  dense FFN, {cfg.n_dense} layers x 3 x {cfg.hidden} x {cfg.dense_ff}: {p['dense_ffn'] / G:.3f} G",
        f"  shared expert + router, {p['n_moe']} layers x (3 x {cfg.hidden} x {cfg.shexp_ff} + {cfg.hidden} x "
        f"{cfg.n_expert}): {p['shared_expert+router'] / G:.3f} G",
        f"  output head {cfg.hidden} x {cfg.vocab}: {p['output'] / G:.3f} G",
        f"  = fixed part F = {p['fixed'] / G:.3f} G",
        f"  one routed expert in all {p['n_moe']} MoE layers: X = {p['n_moe']} x 3 x {cfg.hidden} x {cfg.expert_ff}"
        f" = {p['n_moe'] * p['routed_expert'] / G:.3f} G",
    ]
    for k in (1, 2, 3, 4):
        lines.append(f"  k={k}: distinct experts {cfg.n_expert} x (1 - (1 - {cfg.top_k}/{cfg.n_expert})^{k}) = "
                     f"{p['distinct'][k]:.2f}; T{k} = F + {p['distinct'][k]:.2f} X = {p['target'][k] / G:.3f} G")
    lines.append(f"  one head: eh_proj 2x{cfg.hidden}x{cfg.hidden} + attention (SWA) + dense FFN + output head = "
                 f"{p['head_block'] / G:.3f} + {p['output'] / G:.3f} = {p['head'] / G:.3f} G")
    ratios = {"head/target1": p["head"] / t1}
    lines.append(f"  head / T1 = {p['head'] / G:.3f} / {t1 / G:.3f} = {ratios['head/target1']:.3f}")
    for k in (2, 3, 4):
        ratios[f"verify{k}/target1"] = p["target"][k] / t1
        lines.append(f"  T{k} / T1 = {p['target'][k] / G:.3f} / {t1 / G:.3f} = {ratios[f'verify{k}/target1']:.3f}")
    ratios["head_block/trunk_layer"] = p["head_block"] / ((t1 - p["output"]) / cfg.n_layer)
    lines.append(f"  head block / mean trunk layer = {p['head_block'] / G:.3f} / (({t1 / G:.3f} - "
                 f"{p['output'] / G:.3f}) / {cfg.n_layer}) = {ratios['head_block/trunk_layer']:.2f}")
    return ratios, "\n".join(lines)


def scale_for_mb(mb: float, src_hidden: int = 128, cfg: FlashConfig = FLASH, *,
                 bytes_per_param: float = Q8_0_BYTES) -> float:
    """The ``scale`` at which a 1-row target decode of the shaped model reads about
    ``mb`` MB of weights (every matrix: src_hidden x scale x Step-3.5-Flash's other side;
    Q8_0 unless told)."""
    per_scale = decode_params(cfg)["target"][1] * src_hidden / cfg.hidden * bytes_per_param
    return mb * 1e6 / per_scale


@dataclass
class ShapeResult:
    path: Path
    scale: float
    n_layer: int
    n_embd: int
    n_vocab: tuple[int, int]  #: (real, padded)
    n_expert: int
    top_k: int
    widths: dict[str, tuple[int, int]]  #: name -> (old, new)
    heads: dict[str, tuple[int, int]]  #: "full"/"swa" -> (n_head, n_head_kv) of added layers
    src_bytes: int
    dst_bytes: int


def _round(x: float, m: int) -> int:
    return max(m, int(round(x / m)) * m)


def _blocks(qtype: Any) -> tuple[int, int]:
    import gguf

    return gguf.GGML_QUANT_SIZES[qtype]


class _Tensor:
    """One tensor to write: ggml type, numpy shape of its data, and a producer."""

    def __init__(self, name: str, qtype: Any, np_shape: tuple[int, ...], dtype: Any, make: Any) -> None:
        self.name, self.qtype, self.np_shape, self.dtype, self.make = name, qtype, np_shape, dtype, make


def _place(data: np.ndarray, axis: int, n_new: int, segments: Sequence[tuple[int, int, int]] | None = None,
           fill: np.ndarray | None = None) -> np.ndarray:
    """``data`` with ``axis`` grown to ``n_new``: segments (src, dst, length) of the old
    axis copied to their new place (default: all of it at 0), zeros elsewhere (or
    ``fill`` broadcast into the new, not copied, places)."""
    axis = axis % data.ndim
    shape = list(data.shape)
    shape[axis] = n_new
    out = np.zeros(shape, dtype=data.dtype)
    if fill is not None:
        out[...] = fill
    if segments is None:
        segments = [(0, 0, data.shape[axis])]
    for s, d, n in segments:
        dst = [slice(None)] * data.ndim
        src = [slice(None)] * data.ndim
        dst[axis] = slice(d, d + n)
        src[axis] = slice(s, s + n)
        out[tuple(dst)] = data[tuple(src)]
    return out


def _inner(qtype: Any, n: int) -> int:
    """Numpy length of an inner axis of ``n`` elements (bytes for quantized types)."""
    bs, ts = _blocks(qtype)
    return n if bs == 1 else n // bs * ts


def _head_plan(n_head: int, n_kv: int, n_head_new: int, n_kv_new: int) -> list[int]:
    """New index of each original query head: its key/value head keeps its index, and
    the head keeps its place in that head's group."""
    g, g_new = n_head // n_kv, n_head_new // n_kv_new
    if n_kv_new < n_kv or g_new < g or n_head_new % n_kv_new:
        raise ValueError(f"cannot place {n_head}/{n_kv} heads among {n_head_new}/{n_kv_new}")
    return [(h // g) * g_new + h % g for h in range(n_head)]


def _layer_heads(cfg: FlashConfig, il: int, scale: float, head_dim: int, n_head: int, n_kv: int,
                 full: bool) -> tuple[int, int]:
    """(query heads, key/value heads) of a shaped layer: Step-3.5-Flash's widths for its
    attention kind, scaled, in heads of ``head_dim``; at least as many as trained, with
    groups at least as large."""
    n_kv_new = max(n_kv, round(scale * cfg.n_kv * cfg.head_dim / head_dim))
    real = cfg.n_head_full if full else cfg.n_head_swa
    want = max(scale * real * cfg.head_dim / head_dim, n_kv_new * (n_head // n_kv))
    return _round(want, n_kv_new), n_kv_new


def shape_like_flash(src: str | os.PathLike[str], dst: str | os.PathLike[str], scale: float = 0.25, *,
                     n_layer: int | None = None, hidden: int | None = None, head_dim_new: int | None = None,
                     f16: bool = False, cfg: FlashConfig = FLASH, seed: int = 0,
                     progress: Callable[[float], None] | None = None) -> ShapeResult:
    """Write ``dst``: ``src`` (a ``step35`` GGUF with MTP blocks) shaped like ``cfg``
    (Step-3.5-Flash) at ``scale``; ``n_layer`` trunk layers (default: cfg's); ``hidden``:
    the hidden width (default: the trained one; else the trained one times a power of 4,
    see :func:`_widen_hidden`); ``head_dim_new``: the attention heads' width (default: the
    trained one; else the trained one times a power of 4, the query norm scaled to keep the scores);
    ``f16``: quantized matrices written as F16 (their values rounded to 11 bits), for a
    backend that reads F16 faster than it computes on Q8_0; ``progress``: called with the
    share of the tensor data written so far (the file is gigabytes: about a minute)."""
    import gguf

    from .widen import copy_metadata

    src, dst = Path(src), Path(dst)
    r = gguf.GGUFReader(str(src))
    f = {k: v.contents() for k, v in r.fields.items() if not k.startswith("GGUF.")}
    arch = str(f["general.architecture"])
    a = lambda key: f"{arch}.{key}"  # noqa: E731
    n_block = int(f[a("block_count")])
    n_mtp = int(f.get(a("nextn_predict_layers"), 0))
    if arch != "step35" or n_mtp == 0:
        raise ValueError(f"{src}: not a step35 model with MTP blocks")
    n_trunk = n_block - n_mtp
    n_layer = cfg.n_layer if n_layer is None else n_layer
    if n_layer < n_trunk:
        raise ValueError(f"{src} has {n_trunk} trunk layers, more than {n_layer}")
    n_embd = int(f[a("embedding_length")])
    n_embd_new = n_embd if hidden is None else int(hidden)
    _width_factor(n_embd, n_embd_new)
    head_dim = int(f[a("attention.key_length")])
    hd_new = head_dim if head_dim_new is None else int(head_dim_new)
    # heads r times wider with zero channels: the per-head RMS norms divide by a mean
    # square r times smaller (outputs sqrt(r) times larger, the epsilon r times larger
    # in effect) and the scores are scaled by 1/sqrt(hd_new), sqrt(r) times less; q and
    # k each sqrt(r) times larger make the product r times larger, so the query norm's
    # weights times 1/sqrt(r) (a power of 2: exact) leave every score what it was
    q_norm_factor = _width_factor(head_dim, hd_new, "head")
    n_rot = int(f.get(a("rope.dimension_count"), head_dim))
    n_dense_src = int(f.get(a("leading_dense_block_count"), 0))
    top_k = int(f[a("expert_used_count")])
    n_expert_src = int(f[a("expert_count")])
    n_expert = max(n_expert_src, round(top_k * cfg.n_expert / cfg.top_k))
    tensors = {t.name: t for t in r.tensors}
    tokens = list(f["tokenizer.ggml.tokens"])
    n_vocab = len(tokens)
    n_vocab_new = max(n_vocab, _round(scale * cfg.vocab, 32))
    widths = {
        "feed_forward_length": (int(f[a("feed_forward_length")]), _round(scale * cfg.dense_ff, 32)),
        "expert_feed_forward_length": (int(f[a("expert_feed_forward_length")]),
                                       _round(scale * cfg.expert_ff * cfg.top_k / top_k, 32)),
        "expert_shared_feed_forward_length": (int(f[a("expert_shared_feed_forward_length")]),
                                              _round(scale * cfg.shexp_ff, 32)),
    }
    widths = {k: (o, max(o, n)) for k, (o, n) in widths.items()}
    ff, eff, sff = (widths[k][1] for k in ("feed_forward_length", "expert_feed_forward_length",
                                            "expert_shared_feed_forward_length"))
    heads_src = list(f[a("attention.head_count")])
    kv_src = list(f[a("attention.head_count_kv")])
    swa_src = list(f.get(a("attention.sliding_window_pattern"), [False] * n_block))

    # new layer il -> old layer (None: an identity layer)
    old_of = [i if i < n_trunk else None for i in range(n_layer)] + [n_trunk + j for j in range(n_mtp)]
    n_block_new = len(old_of)
    swa_new, heads_new, kv_new = [], [], []
    for il, io in enumerate(old_of):
        swa = bool(swa_src[io]) if io is not None else not cfg.is_full(il)
        h, kv = (heads_src[io], kv_src[io]) if io is not None else (heads_src[n_trunk - 1], kv_src[n_trunk - 1])
        nh, nkv = _layer_heads(cfg, il, scale, hd_new, h, kv, not swa)
        swa_new.append(swa)
        heads_new.append(nh)
        kv_new.append(nkv)

    # metadata
    per_layer = {a("attention.head_count"): heads_new, a("attention.head_count_kv"): kv_new,
                 a("attention.sliding_window_pattern"): swa_new}

    def edit(name: str, vtype: Any, value: Any) -> Any:
        if name in per_layer:
            return per_layer[name]
        if vtype == gguf.GGUFValueType.ARRAY and name.startswith(arch + ".") and len(value) == n_block:
            zero = type(value[0])(0)
            return [value[io] if io is not None else zero for io in old_of]
        if name == a("block_count"):
            return n_block_new
        if name == a("embedding_length"):
            return n_embd_new
        if name == a("expert_count"):
            return n_expert
        if name in (a("attention.key_length"), a("attention.value_length")):
            return hd_new
        if name.startswith(arch + ".") and name[len(arch) + 1:] in widths:
            return widths[name[len(arch) + 1:]][1]
        if name == "tokenizer.ggml.tokens":
            return tokens + [PAD_TOKEN.format(i) for i in range(n_vocab_new - n_vocab)]
        if name == "tokenizer.ggml.token_type":
            return list(value) + [int(gguf.TokenType.UNUSED)] * (n_vocab_new - n_vocab)
        if name == "general.name":
            return f"{value} (Step-3.5-Flash cost shape, scale {scale:g})"
        return value

    w = copy_metadata(r, dst, edit)
    if hd_new != head_dim and a("rope.dimension_count") not in f:
        # rotated dimensions default to the head's width: the trained ones rotate, the
        # added ones stay zero
        w.add_uint32(a("rope.dimension_count"), n_rot)
    shape_doc = {"scale": scale, "n_layer": n_layer, "n_embd": [n_embd, n_embd_new], "head_dim": [head_dim, hd_new], "n_expert": n_expert, "top_k": top_k,
                 "n_vocab": [n_vocab, n_vocab_new], "widths": widths, "flash": asdict(cfg)}
    w.add_string("stepmtp.bench_shape", json.dumps(shape_doc, sort_keys=True))

    plan: list[_Tensor] = []
    rng = np.random.default_rng(seed)

    def keep(name: str, t: Any) -> None:
        if n_embd_new != n_embd and _hidden_axes(name)[0] is not None:
            grown(name, t, lambda t: t.data)
            return
        plan.append(_Tensor(name, t.tensor_type, tuple(t.data.shape), t.data.dtype, lambda t=t: t.data))

    def grown(name: str, t: Any, make: Any) -> None:
        data = _widen_hidden(name, np.asarray(make(t)), t.tensor_type, n_embd, n_embd_new)
        plan.append(_Tensor(name, t.tensor_type, tuple(data.shape), data.dtype, lambda d=data: d))

    def vocab_rows(t: Any, mean_rows: bool) -> np.ndarray:
        """Output or embedding matrix with the padded vocabulary's rows: the mean of the
        real rows (output heads: a padded logit is the mean real logit) or zeros."""
        from gguf.quants import dequantize, quantize

        data = np.asarray(t.data)
        fill = None
        if mean_rows:
            real = dequantize(data, t.tensor_type).reshape(n_vocab, n_embd).astype(np.float64)
            mean = real.mean(0, keepdims=True).astype(np.float32)
            fill = quantize(mean, t.tensor_type) if _blocks(t.tensor_type)[0] > 1 else mean.astype(data.dtype)
        return _place(data, 0, n_vocab_new, fill=fill)

    for name, t in tensors.items():
        if not name.startswith("blk."):
            if name in ("output.weight", "token_embd.weight"):
                grown(name, t, lambda t, m=name == "output.weight": vocab_rows(t, m))
            else:
                keep(name, t)

    def layer_tensors(il: int, io: int) -> Iterator[tuple[str, Any]]:
        pre = f"blk.{io}."
        for name, t in tensors.items():
            if name.startswith(pre):
                yield name[len(pre):], t

    for il, io in enumerate(old_of):
        if io is None:
            plan.extend(_identity_layer(il, tensors, n_trunk - 1, heads_new[il], kv_new[il], hd_new, n_embd,
                                        n_expert, eff, sff, rng, n_embd_new))
            continue
        nh, nkv = heads_src[io], kv_src[io]
        where = _head_plan(nh, nkv, heads_new[il], kv_new[il])
        q_rows = [(h * head_dim, p * hd_new, head_dim) for h, p in enumerate(where)]
        kv_rows = [(j * head_dim, j * hd_new, head_dim) for j in range(nkv)]
        gate_rows = [(h, p, 1) for h, p in enumerate(where)]
        for suffix, t in layer_tensors(il, io):
            name = f"blk.{il}.{suffix}"
            qt = t.tensor_type
            if suffix == "attn_q.weight":
                grown(name, t, lambda t: _place(t.data, -2, heads_new[il] * hd_new, q_rows))
            elif suffix in ("attn_k.weight", "attn_v.weight"):
                grown(name, t, lambda t: _place(t.data, -2, kv_new[il] * hd_new, kv_rows))
            elif suffix in ("attn_q_norm.weight", "attn_k_norm.weight"):
                factor = q_norm_factor if suffix == "attn_q_norm.weight" else 1.0
                grown(name, t, lambda t, c=factor: _place(np.asarray(t.data) * np.asarray(c, t.data.dtype), -1, hd_new))
            elif suffix == "attn_gate.weight":
                grown(name, t, lambda t: _place(t.data, -2, heads_new[il], gate_rows))
            elif suffix == "attn_output.weight":
                seg = [(_inner(qt, s), _inner(qt, d), _inner(qt, n)) for s, d, n in q_rows]
                grown(name, t, lambda t, seg=seg, qt=qt: _place(t.data, -1, _inner(qt, heads_new[il] * hd_new), seg))
            elif suffix in ("ffn_gate.weight", "ffn_up.weight"):
                grown(name, t, lambda t: _place(t.data, -2, ff))
            elif suffix == "ffn_down.weight":
                grown(name, t, lambda t, qt=qt: _place(t.data, -1, _inner(qt, ff)))
            elif suffix in ("ffn_gate_shexp.weight", "ffn_up_shexp.weight"):
                grown(name, t, lambda t: _place(t.data, -2, sff))
            elif suffix == "ffn_down_shexp.weight":
                grown(name, t, lambda t, qt=qt: _place(t.data, -1, _inner(qt, sff)))
            elif suffix in ("ffn_gate_exps.weight", "ffn_up_exps.weight"):
                grown(name, t, lambda t: _place(_place(t.data, -2, eff), 0, n_expert))
            elif suffix == "ffn_down_exps.weight":
                grown(name, t, lambda t, qt=qt: _place(_place(t.data, -1, _inner(qt, eff)), 0, n_expert))
            elif suffix == "ffn_gate_inp.weight":
                grown(name, t, lambda t: _place(t.data, -2, n_expert))
            elif suffix == "exp_probs_b.bias":
                grown(name, t, lambda t: _place(t.data, -1, n_expert, fill=np.asarray(NEVER_ROUTED, t.data.dtype)))
            elif suffix == "nextn.shared_head_head.weight":
                grown(name, t, lambda t: vocab_rows(t, True))
            else:
                keep(name, t)

    if f16:
        plan = [_as_f16(t) for t in plan]
    for t in plan:
        nbytes = int(np.prod(t.np_shape)) * np.dtype(t.dtype).itemsize
        raw = None if np.dtype(t.dtype) != np.uint8 else t.qtype
        w.add_tensor_info(t.name, t.np_shape, np.dtype(t.dtype), nbytes, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    total = sum(int(np.prod(t.np_shape)) * np.dtype(t.dtype).itemsize for t in plan)
    written = 0
    for t in plan:
        data = np.ascontiguousarray(t.make())
        if data.shape != t.np_shape:
            raise AssertionError(f"{t.name}: made {data.shape}, declared {t.np_shape}")
        w.write_tensor_data(data)
        written += data.nbytes
        if progress is not None:
            progress(written / total)
    w.close()
    kinds = {}
    for il in range(n_trunk, n_layer):
        kinds.setdefault("swa" if swa_new[il] else "full", (heads_new[il], kv_new[il]))
    return ShapeResult(dst, scale, n_layer, n_embd_new, (n_vocab, n_vocab_new), n_expert, top_k,
                       {**widths, "expert_count": (n_expert_src, n_expert)}, kinds,
                       src.stat().st_size, dst.stat().st_size)


#: Tensors with the hidden width on an axis (suffix after ``blk.N.``, or the whole name):
#: "in": the inner (ggml ne0) axis, "out": the next one, "both", "norm": an RMS norm's
#: weight over the hidden state. eh_proj's input is two hidden states side by side.
_HIDDEN_IN = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_gate.weight", "ffn_gate.weight",
              "ffn_up.weight", "ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_gate_exps.weight",
              "ffn_up_exps.weight", "ffn_gate_inp.weight", "nextn.shared_head_head.weight", "output.weight",
              "token_embd.weight")
_HIDDEN_OUT = ("attn_output.weight", "ffn_down.weight", "ffn_down_shexp.weight", "ffn_down_exps.weight")
_HIDDEN_NORM = ("attn_norm.weight", "ffn_norm.weight", "nextn.enorm.weight", "nextn.hnorm.weight",
                "nextn.shared_head_norm.weight", "output_norm.weight")


def _hidden_axes(name: str) -> tuple[str | None, Any]:
    """(kind, inner length as a function of the hidden width) of a tensor, by name."""
    suffix = name.split(".", 2)[2] if name.startswith("blk.") else name
    if suffix == "nextn.eh_proj.weight":
        return "both", lambda n: 2 * n
    if suffix in _HIDDEN_IN:
        return "in", lambda n: n
    if suffix in _HIDDEN_OUT:
        return "out", lambda n: n
    if suffix in _HIDDEN_NORM:
        return "norm", lambda n: n
    return None, None


def _width_factor(old: int, new: int, what: str = "hidden") -> float:
    """sqrt(old / new), which must be exact: the new width is the old one times a power
    of 4 (``what``: the width's name, for the error)."""
    r = new // old
    if new % old or r < 1 or r & (r - 1) or (r.bit_length() - 1) % 2:
        raise ValueError(f"the {what} width {new} is not {old} times a power of 4")
    return 1.0 / math.isqrt(r)


def _widen_hidden(name: str, data: np.ndarray, qtype: Any, n_embd: int, n_embd_new: int) -> np.ndarray:
    """``data`` with the hidden width grown from ``n_embd`` to ``n_embd_new`` by zero
    channels after the trained ones. A matrix's dot products then add exact zeros. An RMS
    norm divides by the mean square over the wider state, sqrt(new / old) times smaller;
    its weight is scaled by the inverse, a power of 2 and so exact, and the padded
    channels stay zero. What moves is the norm's epsilon, now new / old times larger
    against the trained channels' mean square (1e-5 -> 4e-5 at 4x, against mean squares
    of order 1): the predictions are the trained model's up to that and summation order."""
    kind, inner_n = _hidden_axes(name)
    if kind is None or n_embd_new == n_embd:
        return data
    if kind == "norm":
        return _place(data * np.asarray(_width_factor(n_embd, n_embd_new), data.dtype), -1, n_embd_new)
    if kind in ("in", "both"):
        n_old = _inner(qtype, inner_n(n_embd))
        if data.shape[-1] != n_old:
            raise AssertionError(f"{name}: inner axis {data.shape[-1]}, expected {n_old}")
        seg = [(0, 0, _inner(qtype, n_embd))]
        if kind == "both":  # [embedding | hidden state]: each half keeps its place in its half
            seg.append((_inner(qtype, n_embd), _inner(qtype, n_embd_new), _inner(qtype, n_embd)))
        data = _place(data, -1, _inner(qtype, inner_n(n_embd_new)), seg)
    if kind in ("out", "both"):
        data = _place(data, -2, n_embd_new)
    return data



def _as_f16(t: _Tensor) -> _Tensor:
    """``t`` as F16 if it is quantized (norms, routers and biases are F32 and stay so)."""
    import gguf
    from gguf.quants import dequantize

    bs, ts = _blocks(t.qtype)
    if bs == 1:
        return t
    shape = t.np_shape[:-1] + (t.np_shape[-1] // ts * bs,)
    return _Tensor(t.name, gguf.GGMLQuantizationType.F16, shape, np.dtype(np.float16),
                   lambda t=t: dequantize(np.asarray(t.make()), t.qtype).astype(np.float16))


def _identity_layer(il: int, tensors: dict[str, Any], template: int, n_head: int, n_kv: int, head_dim: int,
                    n_embd: int, n_expert: int, eff: int, sff: int, rng: np.random.Generator,
                    n_embd_new: int | None = None) -> list[_Tensor]:
    """A MoE layer that leaves the residual unchanged: zero attention output and zero
    down projections (zero elsewhere too, but for the norms and a random router), with
    the types of the trained layer ``template``."""
    out = []
    rows = {"attn_q.weight": n_head * head_dim, "attn_k.weight": n_kv * head_dim, "attn_v.weight": n_kv * head_dim,
            "attn_gate.weight": n_head, "ffn_gate_shexp.weight": sff, "ffn_up_shexp.weight": sff}
    pre = f"blk.{template}."
    for name, t in tensors.items():
        if not name.startswith(pre):
            continue
        suffix = name[len(pre):]
        qt, dtype = t.tensor_type, t.data.dtype
        shape = list(t.data.shape)
        if suffix in rows:
            shape[-2] = rows[suffix]
        elif suffix == "attn_output.weight":
            shape[-1] = _inner(qt, n_head * head_dim)
        elif suffix == "ffn_down_shexp.weight":
            shape[-1] = _inner(qt, sff)
        elif suffix in ("attn_q_norm.weight", "attn_k_norm.weight"):
            shape[-1] = head_dim
        elif suffix in ("ffn_gate_exps.weight", "ffn_up_exps.weight"):
            shape[0], shape[-2] = n_expert, eff
        elif suffix == "ffn_down_exps.weight":
            shape[0], shape[-1] = n_expert, _inner(qt, eff)
        elif suffix == "ffn_gate_inp.weight":
            shape[-2] = n_expert
        elif suffix == "exp_probs_b.bias":
            shape[-1] = n_expert
        if n_embd_new is not None and n_embd_new != n_embd:
            kind, inner_n = _hidden_axes(name)
            if kind == "norm":
                shape[-1] = n_embd_new
            if kind in ("in", "both"):
                shape[-1] = _inner(qt, inner_n(n_embd_new))
            if kind in ("out", "both"):
                shape[-2] = n_embd_new
        shape_t = tuple(shape)
        if suffix.endswith("norm.weight"):
            make = lambda s=shape_t, d=dtype: np.ones(s, dtype=d)  # noqa: E731
        elif suffix == "ffn_gate_inp.weight":
            if _blocks(qt)[0] != 1:
                raise ValueError(f"{name}: a quantized router is not supported")
            router = (rng.standard_normal(shape_t) / math.sqrt(shape_t[-1])).astype(dtype)
            make = lambda r=router: r  # noqa: E731
        else:
            make = lambda s=shape_t, d=dtype: np.zeros(s, dtype=d)  # noqa: E731
        out.append(_Tensor(f"blk.{il}.{suffix}", qt, shape_t, dtype, make))
    return out


def measure_costs(path: str | os.PathLike[str], *, n: int = 40, prompt: str | None = None,
                  n_threads: int | None = None) -> dict[str, float]:
    """Median seconds of the decodes a round is made of, on ``path``, interleaved so
    that machine drift hits all alike: a 1-row target decode (``target1``), k-row
    target decodes (``target2..4``, consecutive tokens of a text, every row an output,
    as a verify), and 1-row decodes of each head (``head0..``), all with hidden rows
    out as the driver asks for them; and their ratios to ``target1``."""
    from ..llama import Batch, Context, Model

    m = Model(str(path))
    tctx = Context(m, n_ctx=1024, n_threads=n_threads)
    dctx = Context(m, n_ctx=1024, mtp=True, n_threads=n_threads)
    tctx.set_nextn(True, masked=True)
    dctx.set_nextn(True, masked=True)
    text = prompt or (Path(__file__).with_name("flash.py").read_text()[:6000])
    toks = m.tokenize(text)[:600]
    n0 = 200
    b = Batch(1024)
    b.fill(toks[:n0], 0, outputs="last")
    tctx.decode(b)
    db = Batch(8, n_embd=m.n_embd)
    row = tctx.nextn(1).copy()
    times: dict[str, list[float]] = {}
    import time

    for i in range(n):
        at = n0 + (i * 5) % (len(toks) - n0 - 5)
        for k in (1, 2, 3, 4):
            b.fill(toks[at:at + k], n0, outputs="all")
            t0 = time.perf_counter()
            tctx.decode(b)
            times.setdefault(f"target{k}", []).append(time.perf_counter() - t0)
            tctx.seq_rm(0, n0)
        for h in range(m.n_mtp_blocks):
            dctx.mtp_offset = h
            db.fill(toks[at:at + 1], n0, outputs="last", embd=row)
            t0 = time.perf_counter()
            dctx.decode(db)
            times.setdefault(f"head{h}", []).append(time.perf_counter() - t0)
            dctx.seq_rm(0, n0)
    med = {k: float(np.median(v)) for k, v in times.items()}
    t1 = med["target1"]
    out = dict(med)
    out.update({f"{k}/target1": v / t1 for k, v in med.items() if k != "target1"})
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m stepmtp.bench.flash", description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path, nargs="?")
    ap.add_argument("dst", type=Path, nargs="?")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--scale", type=float, default=None, help="Step-3.5-Flash's widths times this (default 0.25)")
    g.add_argument("--mb", type=float, default=None, help="choose the scale for this many MB read per decode")
    ap.add_argument("--layers", type=int, default=None, help=f"trunk layers (default {FLASH.n_layer})")
    ap.add_argument("--hidden", type=int, default=None,
                    help="hidden width: the trained one times a power of 4 (default: the trained one)")
    ap.add_argument("--head-dim", type=int, default=None,
                    help="attention head width: the trained one times a power of 4 (default: the trained one)")
    ap.add_argument("--f16", action="store_true", help="write the quantized matrices as F16")
    ap.add_argument("--estimate", action="store_true", help="print Step-3.5-Flash's cost ratios and exit")
    ap.add_argument("--measure", type=Path, metavar="GGUF", help="time the decodes of a round on a model and exit")
    ap.add_argument("-n", type=int, default=40, help="--measure: decodes of each kind (default 40)")
    args = ap.parse_args(argv)
    if args.estimate:
        print(estimate_costs()[1])
        return 0
    if args.measure:
        for k, v in measure_costs(args.measure, n=args.n).items():
            print(f"{k:18s} {v * 1e3:9.2f} ms" if "/" not in k else f"{k:18s} {v:9.3f}")
        return 0
    if args.src is None or args.dst is None:
        ap.error("give SRC and DST (or --estimate)")
    scale = args.scale if args.scale is not None else scale_for_mb(args.mb) if args.mb else 0.25
    res = shape_like_flash(args.src, args.dst, scale, n_layer=args.layers, hidden=args.hidden, head_dim_new=args.head_dim,
                           f16=args.f16)
    for k, (o, n) in res.widths.items():
        print(f"{k:36s} {o} -> {n}")
    print(f"layers {res.n_layer} + MTP, heads (q/kv) of added layers {res.heads}, top-{res.top_k} of {res.n_expert} "
          f"experts, vocab {res.n_vocab[0]} -> {res.n_vocab[1]}")
    print(f"{res.path}: {res.src_bytes / 1e6:.1f} MB -> {res.dst_bytes / 1e6:.1f} MB", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
