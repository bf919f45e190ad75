"""Widen a GGUF with zero-weight FFN channels: bigger, slower to read, same predictions.

On a CPU a small model fits in cache, so decoding it is compute-bound and hides what
speculative decoding buys on real hardware, where a single-token decode is bound by
reading the weights. ``widen`` makes a bench-size variant whose decode is memory-bound
while its outputs stay those of the original: it appends zero channels to the FFNs.

A SwiGLU FFN computes ``down @ (silu(gate @ x) * (up @ x))``. Extra rows of ``gate``
and ``up`` that are zero give extra channels ``silu(0) * 0 = 0`` (a SwiGLU clamp keeps
0 at 0), and the matching extra columns of ``down`` are zero too, so every output is
unchanged (up to the summation order of the longer dot products, i.e. float
rounding). What can be widened (``parts``):

* ``experts``: the routed experts (``ffn_{gate,up,down}_exps``, key
  ``expert_feed_forward_length``);
* ``shexp``: the shared expert (``ffn_{gate,up,down}_shexp``, key
  ``expert_shared_feed_forward_length``);
* ``dense``: the dense FFNs (``ffn_{gate,up,down}``, key ``feed_forward_length``).

The default widens ``experts`` and ``shexp`` only: those live in the trunk, like most
of a real model's bytes. In ``step35`` the dense width is one value shared by the
leading dense layer and the MTP blocks, so widening it would make the heads as costly
to run as the trunk layers, which a real model's single MTP layer per head is not.

Quantized tensors are widened at the byte level (a block of zero bytes is zero in
every ggml type), so a Q8_0 model stays Q8_0. Every metadata key is copied; only the
width keys change.

    python -m stepmtp.bench.widen SRC.gguf DST.gguf --size-mb 400
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

__all__ = ["widen", "WidenResult", "PARTS", "copy_metadata"]

#: part -> (width key without the arch prefix, tensor suffixes widened on the row axis,
#: tensor suffixes widened on the inner axis)
PARTS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "experts": ("expert_feed_forward_length", ("ffn_gate_exps.weight", "ffn_up_exps.weight"),
                ("ffn_down_exps.weight",)),
    "shexp": ("expert_shared_feed_forward_length", ("ffn_gate_shexp.weight", "ffn_up_shexp.weight"),
              ("ffn_down_shexp.weight",)),
    "dense": ("feed_forward_length", ("ffn_gate.weight", "ffn_up.weight"), ("ffn_down.weight",)),
}

_NATIVE = {np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.float64), np.dtype(np.int8),
           np.dtype(np.int16), np.dtype(np.int32), np.dtype(np.int64)}


@dataclass
class WidenResult:
    path: Path
    #: part -> (old width, new width)
    widths: dict[str, tuple[int, int]]
    src_bytes: int
    dst_bytes: int
    n_tensors_widened: int


def _part_of(name: str, parts: Sequence[str]) -> tuple[str, int] | None:
    """(part, axis) of a tensor to widen: axis -2 (rows) or -1 (inner), else None."""
    if not name.startswith("blk."):
        return None
    for part in parts:
        _, rows, inner = PARTS[part]
        if name.endswith(tuple("." + s for s in rows)):
            return part, -2
        if name.endswith(tuple("." + s for s in inner)):
            return part, -1
    return None


def _pad(data: np.ndarray, axis: int, extra: int) -> np.ndarray:
    shape = list(data.shape)
    shape[axis] = extra
    return np.concatenate([np.asarray(data), np.zeros(shape, dtype=data.dtype)], axis=axis)


def copy_metadata(reader: Any, dst: str | os.PathLike[str], edit: Callable[[str, Any, Any], Any]) -> Any:
    """A GGUFWriter for ``dst`` with every metadata key of ``reader``, each value passed
    through ``edit(name, value type, value)``."""
    import gguf

    w = gguf.GGUFWriter(str(dst), str(reader.fields["general.architecture"].contents()))
    if "general.alignment" in reader.fields:
        w.data_alignment = int(reader.fields["general.alignment"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, edit(name, vtype, field.contents()), vtype, sub_type=sub)
    return w


def widen(src: str | os.PathLike[str], dst: str | os.PathLike[str], factor: float | None = None, *,
          target_mb: float | None = None, parts: Sequence[str] = ("experts", "shexp"),
          align: int | None = None) -> WidenResult:
    """Write ``dst``: ``src`` with the widths of ``parts`` multiplied by ``factor``, or
    chosen so that the file is about ``target_mb`` MB. New widths are rounded up to a
    multiple of ``align`` (default: 64, or the largest quantization block involved)."""
    import gguf

    if (factor is None) == (target_mb is None):
        raise ValueError("give either factor or target_mb")
    for p in parts:
        if p not in PARTS:
            raise ValueError(f"unknown part {p!r} (one of {', '.join(PARTS)})")
    src, dst = Path(src), Path(dst)
    reader = gguf.GGUFReader(str(src))
    arch = str(reader.fields["general.architecture"].contents())

    # the widths now, and the bytes each unit of width costs
    widths: dict[str, int] = {}
    per_unit: dict[str, float] = {p: 0.0 for p in parts}
    block = 1
    n_hits = 0
    for p in parts:
        key = f"{arch}.{PARTS[p][0]}"
        if key not in reader.fields:
            raise ValueError(f"{src}: no {key} (nothing to widen for {p!r})")
        widths[p] = int(reader.fields[key].contents())
    for t in reader.tensors:
        hit = _part_of(t.name, parts)
        if hit is None:
            continue
        part, axis = hit
        ne = [int(x) for x in t.shape]  # ggml order: ne[0] inner
        have = ne[1] if axis == -2 else ne[0]
        if have != widths[part]:
            raise ValueError(f"{src}: {t.name} has width {have}, {PARTS[part][0]} says {widths[part]}")
        per_unit[part] += t.n_bytes / widths[part]
        block = max(block, gguf.GGML_QUANT_SIZES[t.tensor_type][0])
        n_hits += 1
    if n_hits == 0:
        raise ValueError(f"{src}: no tensor of {', '.join(parts)} to widen")
    align = align or max(64, block)
    if align % block:
        raise ValueError(f"align {align} is not a multiple of the quantization block {block}")

    src_bytes = src.stat().st_size
    if factor is None:
        grow = sum(widths[p] * per_unit[p] for p in parts)
        factor = 1.0 + max(0.0, target_mb * 1e6 - src_bytes) / grow
    if factor < 1.0:
        raise ValueError(f"factor {factor} < 1: widen only grows a model")
    new = {p: int(math.ceil(widths[p] * factor / align) * align) for p in parts}
    new = {p: max(w, widths[p]) for p, w in new.items()}

    keys = {f"{arch}.{PARTS[p][0]}": new[p] for p in parts}
    w = copy_metadata(reader, dst, lambda name, vtype, value: keys.get(name, value))

    plan = []
    for t in reader.tensors:
        data = t.data
        raw = None if data.dtype in _NATIVE else t.tensor_type
        hit = _part_of(t.name, parts)
        extra_axis, extra = None, 0
        shape = list(data.shape)
        if hit is not None:
            part, axis = hit
            extra = new[part] - widths[part]
            if axis == -1 and raw is not None:  # bytes along the inner axis
                bs, ts = gguf.GGML_QUANT_SIZES[t.tensor_type]
                extra = extra // bs * ts
            extra_axis = axis
            shape[axis] += extra
        nbytes = int(np.prod(shape)) * data.dtype.itemsize
        w.add_tensor_info(t.name, shape, data.dtype, nbytes, raw_dtype=raw)
        plan.append((t, extra_axis, extra))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t, axis, extra in plan:
        data = t.data if axis is None or extra == 0 else _pad(t.data, axis, extra)
        w.write_tensor_data(np.ascontiguousarray(data))
    w.close()
    return WidenResult(dst, {p: (widths[p], new[p]) for p in parts}, src_bytes, dst.stat().st_size, n_hits)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m stepmtp.bench.widen", description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--factor", type=float, help="multiply the widths by this")
    g.add_argument("--size-mb", type=float, help="choose the widths for a file of about this size")
    ap.add_argument("--parts", default="experts,shexp",
                    help=f"comma-separated, of {', '.join(PARTS)} (default: experts,shexp)")
    args = ap.parse_args(argv)
    r = widen(args.src, args.dst, args.factor, target_mb=args.size_mb,
              parts=[p for p in args.parts.split(",") if p])
    for p, (a, b) in r.widths.items():
        print(f"{p:8s} {a} -> {b}")
    print(f"{r.path}: {r.src_bytes / 1e6:.1f} MB -> {r.dst_bytes / 1e6:.1f} MB "
          f"({r.n_tensors_widened} tensors widened)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
