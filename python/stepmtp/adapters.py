"""LoRA adapters and control vectors on the target (llama-server's ``--lora``,
``--lora-scaled``, ``--control-vector``, ``--control-vector-scaled``,
``--control-vector-layer-range``, ``/lora-adapters`` and a request's ``lora``).

They change the target's context only. The MTP heads draft from the trunk's hidden
rows, which the adapters shape, and the target verifies every draft with the adapters
on: at temperature 0 the text is plain decoding's with the same adapters.

A sequence's KV is computed under one set of LoRA scales, so a cached prefix is reused
only by a request with the same scales (``Adapters.key``: the slots, host memory and
context checkpoints carry it). The control vector is fixed for the engine's life, as
in llama-server.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Sequence

import numpy as np

from .binding import ErrorCapture, ffi, lib
from .llama import ModelLoadError

if TYPE_CHECKING:
    from .llama import Context, Model

__all__ = ["Adapters", "LoraAdapter", "load_control_vector", "parse_lora"]


@dataclass
class LoraAdapter:
    """One LoRA adapter file loaded for a model (llama.cpp frees it with the model)."""

    path: str
    #: the scale it was given at start (--lora: 1, --lora-scaled: its own)
    scale: float
    ptr: object

    @classmethod
    def load(cls, model: "Model", path: str | os.PathLike[str], scale: float) -> "LoraAdapter":
        """ModelLoadError with llama.cpp's reason for a file it refuses (not an adapter,
        another architecture, a tensor the model lacks or of another shape)."""
        p = os.fspath(path)
        if not os.path.isfile(p):
            raise ModelLoadError(f"{p}: no such LoRA adapter file")
        with ErrorCapture() as cap:
            ptr = lib.llama_adapter_lora_init(model.ptr, os.fsencode(p))
        if ptr == ffi.NULL:
            raise ModelLoadError(cap.message(f"{p}: llama.cpp could not load the LoRA adapter"))
        return cls(p, float(scale), ptr)


def load_control_vector(files: Sequence[tuple[str, float]], n_embd: int) -> np.ndarray:
    """The control vectors of ``files`` (path, strength), summed: a [n_layers, n_embd]
    float32 array whose row i is layer i + 1's direction (llama.cpp never adds one to
    layer 0). A file holds 1-D F32 tensors named ``direction.<layer>``; ModelLoadError
    names what is wrong with one that does not."""
    import gguf

    rows: dict[int, np.ndarray] = {}
    for path, strength in files:
        try:
            reader = gguf.GGUFReader(path)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{path}: not a control vector file: {e}") from None
        if not reader.tensors:
            raise ModelLoadError(f"{path}: no direction tensors")
        for t in reader.tensors:
            kind, _, layer = t.name.partition(".")
            if kind != "direction" or not layer.isdigit() or int(layer) == 0:
                raise ModelLoadError(f"{path}: tensor {t.name!r} is not direction.<layer>, layer 1 or more")
            if t.tensor_type != gguf.GGMLQuantizationType.F32 or len(t.shape) != 1:
                raise ModelLoadError(f"{path}: tensor {t.name!r} is not a one-dimensional F32 vector")
            if int(t.shape[0]) != n_embd:
                raise ModelLoadError(f"{path}: tensor {t.name!r} has {int(t.shape[0])} values, the model's "
                                     f"hidden rows {n_embd}")
            il = int(layer)
            # several files, or several directions of one layer in a file, add up
            rows[il] = rows.get(il, np.zeros(n_embd, np.float32)) + np.asarray(t.data, np.float32) * strength
    out = np.zeros((max(rows), n_embd), np.float32)
    for il, v in rows.items():
        out[il - 1] = v
    return out


class Adapters:
    """An engine's LoRA adapters (their current scales, which ``/lora-adapters`` sets)
    and its control vector, and which of them the target's context computes with.

    Args:
        model: the target model.
        lora: (path, scale) per adapter, in llama-server's order (ids are indices).
        init_without_apply: every scale starts at 0 (--lora-init-without-apply).
        control_vectors: (path, strength) per control vector file.
        layer_range: (start, end), inclusive, the layers the control vector is added
            to (default: 1 to the model's last).
    """

    def __init__(self, model: "Model", lora: Sequence[tuple[str, float]] = (), *,
                 init_without_apply: bool = False, control_vectors: Sequence[tuple[str, float]] = (),
                 layer_range: tuple[int, int] | None = None) -> None:
        self.loras = [LoraAdapter.load(model, p, s) for p, s in lora]
        #: the scales a request without its own ``lora`` runs with
        self.scales: list[float] = [0.0 if init_without_apply else a.scale for a in self.loras]
        self._ptrs = ffi.new("struct llama_adapter_lora *[]", [a.ptr for a in self.loras]) if self.loras else None
        self.cvec: np.ndarray | None = None
        self.layer_range = (0, 0)
        if control_vectors:
            self.cvec = load_control_vector(control_vectors, model.n_embd)
            start, end = layer_range or (0, 0)
            # llama-server: a range bound of 0 or less is the first (1) or last layer
            n_layer = lib.llama_model_n_layer(model.ptr)
            self.layer_range = (start if start > 0 else 1, end if end > 0 else n_layer)
        #: the scales each context computes with now, by id(context)
        self._applied: dict[int, tuple[float, ...]] = {}

    def __bool__(self) -> bool:
        return bool(self.loras) or self.cvec is not None

    def key(self, lora: Mapping[int, float] | None = None) -> tuple[float, ...]:
        """The scales a request runs with: the current ones, or its own ``lora`` (id ->
        scale) where the adapters it does not name are off (llama-server's rule; ids
        that name no adapter are ignored, as there)."""
        if lora is None:
            return tuple(self.scales)
        return tuple(float(lora.get(i, 0.0)) for i in range(len(self.loras)))

    def set_scales(self, lora: Mapping[int, float]) -> None:
        """POST /lora-adapters: the scales of requests that do not give their own."""
        self.scales = list(self.key(lora))

    def attach(self, ctx: "Context") -> None:
        """Put the control vector on ``ctx`` (once: it does not change) and the current
        scales."""
        if self.cvec is not None:
            with ErrorCapture() as cap:
                rc = lib.llama_set_adapter_cvec(ctx.ptr, ffi.cast("float *", self.cvec.ctypes.data), self.cvec.size,
                                                self.cvec.shape[1], *self.layer_range)
            if rc != 0:
                raise ModelLoadError(cap.message("llama.cpp refused the control vector"))
        self.apply(ctx, self.key())

    def apply(self, ctx: "Context", key: tuple[float, ...]) -> None:
        """Make ``ctx`` compute with the adapters at these scales (a no-op when it
        already does; a change makes llama.cpp rebuild its graphs on the next decode)."""
        if not self.loras or self._applied.get(id(ctx)) == key:
            return
        scales = ffi.new("float[]", list(key))
        lib.llama_set_adapters_lora(ctx.ptr, self._ptrs, len(self.loras), scales)
        self._applied[id(ctx)] = key

    def describe(self) -> list[dict[str, object]]:
        """GET /lora-adapters' entries (llama-server's fields)."""
        return [{"id": i, "path": a.path, "scale": self.scales[i], "task_name": "", "prompt_prefix": ""}
                for i, a in enumerate(self.loras)]


def parse_lora(items: object) -> dict[int, float]:
    """A request's or ``POST /lora-adapters``' list of ``{"id": N, "scale": S}`` as
    id -> scale (llama-server's reading: a missing id is -1, a missing scale 0);
    ValueError for anything but such a list."""
    if not isinstance(items, list):
        raise ValueError("'lora' must be an array of objects with 'id' and 'scale' fields")
    out: dict[int, float] = {}
    for item in items:
        if not isinstance(item, dict):
            raise ValueError("'lora' must be an array of objects with 'id' and 'scale' fields")
        i, s = item.get("id", -1), item.get("scale", 0.0)
        if isinstance(i, bool) or not isinstance(i, int) or isinstance(s, bool) or not isinstance(s, (int, float)):
            raise ValueError("a lora entry's 'id' is an integer and its 'scale' a number")
        out[i] = float(s)
    return out
