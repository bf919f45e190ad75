"""llama.cpp's model and context parameters set by name (llama-server's --override-kv,
-lm, --no-repack, --no-host, --check-tensors; rope / YaRN, -nkvo, --no-op-offload):
``Model`` and ``Context`` take them as a mapping, so a flag needs no keyword of its own."""
from __future__ import annotations

from typing import Any, Mapping

from .binding import ffi, lib

#: --override-kv's types -> (the override's tag, the union member it fills)
_KV_TYPES = {"int": ("LLAMA_KV_OVERRIDE_TYPE_INT", "val_i64"), "float": ("LLAMA_KV_OVERRIDE_TYPE_FLOAT", "val_f64"),
             "bool": ("LLAMA_KV_OVERRIDE_TYPE_BOOL", "val_bool"), "str": ("LLAMA_KV_OVERRIDE_TYPE_STR", "val_str")}


def kv_overrides(items: list[tuple[str, str, Any]]) -> Any:
    """(key, type, value) as llama.cpp's override array, ended by an entry with an empty key."""
    arr = ffi.new("struct llama_model_kv_override[]", len(items) + 1)
    for o, (key, kind, value) in zip(arr, items):
        tag, member = _KV_TYPES[kind]
        if len(key.encode()) >= 128 or (kind == "str" and len(str(value).encode()) >= 128):
            raise ValueError(f"override {key}: keys and string values are under 128 bytes")
        o.tag = getattr(lib, tag)
        o.key = key.encode()
        setattr(o, member, value.encode() if kind == "str" else value)
    return arr


def apply(params: Any, values: Mapping[str, Any] | None) -> list[Any]:
    """``values`` set on a llama_model_params / llama_context_params struct; what the
    struct then points into, which must live as long as llama.cpp reads it."""
    keep: list[Any] = []
    for name, value in (values or {}).items():
        if name == "kv_overrides":
            arr = kv_overrides(list(value))
            params.kv_overrides = arr
            keep.append(arr)
        else:
            setattr(params, name, value)
    return keep
