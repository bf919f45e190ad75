"""Where a model's weights and KV cache go: llama-server's placement flags as llama.cpp's
parameters.

- tensor buffer overrides (``-ot``, ``-cmoe``, ``-ncmoe``): ``{pattern, buffer type}``
  pairs in ``llama_model_params.tensor_buft_overrides``; the first pattern found in a
  tensor's name (a regex search, as llama.cpp's std::regex) puts it in that buffer type;
- devices (``-dev``), split mode (``-sm``), tensor split (``-ts``), main GPU (``-mg``);
- KV cache types (``-ctk``, ``-ctv``), for ``llama_context_params``;
- NUMA (``--numa``), which ggml sets once per process.

Names are ggml's: buffer types as ``ggml_backend_buft_name`` gives them (``CPU``,
``CUDA0``, ``RPC0[host:port]``), devices as ``ggml_backend_dev_name`` (``CUDA0``,
``RPC0``). A value llama.cpp cannot take is a ``PlacementError`` naming the option, both
as the Python keyword and as llama-server's flag. On a build without a GPU backend the
GPU options pass through to llama.cpp, which has nothing to apply them to (as with
llama-server); ``-sm tensor`` is refused there by llama.cpp itself.
"""
from __future__ import annotations

import math
import re
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from .binding import ensure_backend, ffi, lib

__all__ = ["PlacementError", "Placement", "KV_TYPES", "SPLIT_MODES", "NUMA_STRATEGIES", "kv_type",
           "kv_type_quantized", "check_kv_types", "parse_overrides", "moe_overrides", "buffer_type_names", "device_names", "list_devices",
           "numa_init", "option_name"]


class PlacementError(ValueError):
    """A placement or KV cache option has a value llama.cpp cannot take; the message
    names the option, as the keyword and as llama-server's flag (``key``, ``flag``;
    ``detail``: the message without them)."""

    def __init__(self, key: str, detail: str, draft: bool = False) -> None:
        self.key, self.detail, self.draft = key, detail, draft
        self.flag = _FLAGS[key][1 if draft else 0]
        super().__init__(f"{option_name(key, draft)}: {detail}")


#: llama-server's -ctk / -ctv values (common/arg.cpp kv_cache_types), in its order
KV_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
_KV_ENUM = {"f32": "GGML_TYPE_F32", "f16": "GGML_TYPE_F16", "bf16": "GGML_TYPE_BF16", "q8_0": "GGML_TYPE_Q8_0",
            "q4_0": "GGML_TYPE_Q4_0", "q4_1": "GGML_TYPE_Q4_1", "iq4_nl": "GGML_TYPE_IQ4_NL",
            "q5_0": "GGML_TYPE_Q5_0", "q5_1": "GGML_TYPE_Q5_1"}

SPLIT_MODES = ("none", "layer", "row", "tensor")
NUMA_STRATEGIES = ("distribute", "isolate", "numactl")

#: llama-server's MoE expert tensors (common.h LLM_FFN_EXPS_REGEX): what -cmoe keeps on the CPU
FFN_EXPS = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"

#: keyword -> llama-server's flags, and the draft model's
_FLAGS = {
    "override_tensor": ("-ot/--override-tensor", "-otd/--override-tensor-draft"),
    "cpu_moe": ("-cmoe/--cpu-moe", "-cmoed/--cpu-moe-draft"),
    "n_cpu_moe": ("-ncmoe/--n-cpu-moe", "-ncmoed/--n-cpu-moe-draft"),
    "devices": ("-dev/--device", "-devd/--device-draft"),
    "type_k": ("-ctk/--cache-type-k", "-ctkd/--cache-type-k-draft"),
    "type_v": ("-ctv/--cache-type-v", "-ctvd/--cache-type-v-draft"),
    "split_mode": ("-sm/--split-mode", "-sm/--split-mode"),
    "tensor_split": ("-ts/--tensor-split", "-ts/--tensor-split"),
    "main_gpu": ("-mg/--main-gpu", "-mg/--main-gpu"),
    "numa": ("--numa", "--numa"),
}


def option_name(key: str, draft: bool = False) -> str:
    """How errors name an option: ``override_tensor_draft (-otd/--override-tensor-draft)``."""
    flags = _FLAGS[key]
    suffix = "_draft" if draft and flags[0] != flags[1] else ""
    return f"{key}{suffix} ({flags[1] if draft else flags[0]})"


# -- KV cache types ----------------------------------------------------------------


def kv_type(name: str, key: str = "type_k", draft: bool = False) -> int:
    """ggml's type for a KV cache type name (llama-server's ``-ctk`` values); ``key``,
    ``draft``: the option, for the error."""
    low = str(name).lower()
    if low not in _KV_ENUM:
        raise PlacementError(key, f"unknown KV cache type {name!r} (allowed: {', '.join(KV_TYPES)})", draft)
    return getattr(lib, _KV_ENUM[low])


def kv_type_quantized(name: str) -> bool:
    """A block-quantized type: llama.cpp stores V so only with flash attention."""
    return str(name).lower() not in ("f32", "f16", "bf16")


def check_kv_types(kv_types: dict[str, tuple[str, str]], flash_attn: bool | None) -> None:
    """PlacementError for an unknown type among ``{"target": (K, V), "draft": (K, V)}``,
    or a quantized V with flash attention off (llama.cpp would refuse the context)."""
    for draft, (k, v) in ((False, kv_types["target"]), (True, kv_types["draft"])):
        kv_type(k, "type_k", draft)
        kv_type(v, "type_v", draft)
        if flash_attn is False and kv_type_quantized(v):
            raise PlacementError("type_v", f"a {v} V cache needs flash attention (flash_attn None or True: "
                                 "-fa auto or on)", draft)


# -- tensor buffer overrides ------------------------------------------------------------


def parse_overrides(spec: str | Iterable[str | tuple[str, str]] | None, draft: bool = False) -> list[tuple[str, str]]:
    """``"pattern=buffer type,..."`` (llama-server's ``-ot``), or a list of such strings
    or of ``(pattern, buffer type)`` pairs, as pairs. Checks the form and that each
    pattern is a regex; the buffer types are checked against the devices at the load."""
    if spec is None:
        return []
    items: list[str | tuple[str, str]] = list(spec.split(",")) if isinstance(spec, str) else list(spec)
    out = []
    for item in items:
        if isinstance(item, str):
            pattern, eq, buft = item.partition("=")
            if not eq:
                raise PlacementError("override_tensor", f"{item!r} is not <tensor name pattern>=<buffer type>", draft)
        else:
            pattern, buft = item
        if not buft:
            raise PlacementError("override_tensor", f"no buffer type after '{pattern}='", draft)
        try:
            re.compile(pattern)
        except re.error as e:
            raise PlacementError("override_tensor", f"the tensor name pattern {pattern!r} is not a regular "
                                 f"expression ({e})", draft) from None
        out.append((str(pattern), str(buft)))
    return out


def moe_overrides(cpu_moe: bool = False, n_cpu_moe: int = 0, draft: bool = False) -> list[tuple[str, str]]:
    """``-cmoe`` (every layer's experts) and ``-ncmoe N`` (the first N layers') as
    overrides to the CPU, with llama-server's patterns."""
    if isinstance(n_cpu_moe, bool) or not isinstance(n_cpu_moe, int) or n_cpu_moe < 0:
        raise PlacementError("n_cpu_moe", f"a number of layers >= 0, not {n_cpu_moe!r}", draft)
    out = [(FFN_EXPS, "CPU")] if cpu_moe else []
    return out + [(rf"blk\.{i}{FFN_EXPS}", "CPU") for i in range(n_cpu_moe)]


def _devices() -> list:
    ensure_backend()
    return [lib.ggml_backend_dev_get(i) for i in range(lib.ggml_backend_dev_count())]


def _name(p: Any) -> str:
    return ffi.string(p).decode("utf-8", "replace")


def _buffer_types(extra_devices: Sequence = ()) -> dict[str, Any]:
    out = {}
    for dev in [*_devices(), *extra_devices]:
        buft = lib.ggml_backend_dev_buffer_type(dev)
        if buft != ffi.NULL:
            out.setdefault(_name(lib.ggml_backend_buft_name(buft)), buft)
    return out


def buffer_type_names(extra_devices: Sequence = ()) -> list[str]:
    """The buffer types ``-ot`` may name: each device's (llama-server's list), and
    those of ``extra_devices`` (a model's RPC servers)."""
    return sorted(_buffer_types(extra_devices))


def _offload_devices(extra_devices: Sequence = ()) -> list:
    return [d for d in [*_devices(), *extra_devices]
            if lib.ggml_backend_dev_type(d) != lib.GGML_BACKEND_DEVICE_TYPE_CPU]


def _offload_by_name(extra_devices: Sequence = ()) -> dict[str, Any]:
    # ggml compares device names without case (ggml_backend_dev_by_name)
    return {_name(lib.ggml_backend_dev_name(d)).lower(): d for d in _offload_devices(extra_devices)}


def device_names(extra_devices: Sequence = ()) -> list[str]:
    """The devices ``-dev`` may name: every device but the CPU (llama-server's
    ``--list-devices``), and ``extra_devices`` (a model's RPC servers)."""
    return [_name(lib.ggml_backend_dev_name(d)) for d in _offload_devices(extra_devices)]


def list_devices() -> list[tuple[str, str, int, int]]:
    """The devices ``-dev`` may name: (name, description, total bytes, free bytes)."""
    out = []
    for d in _offload_devices():
        free, total = ffi.new("size_t *"), ffi.new("size_t *")
        lib.ggml_backend_dev_memory(d, free, total)
        out.append((_name(lib.ggml_backend_dev_name(d)), _name(lib.ggml_backend_dev_description(d)),
                    int(total[0]), int(free[0])))
    return out


def _parse_devices(spec: str | Sequence[str] | None, draft: bool) -> tuple[str, ...] | None:
    if spec is None:
        return None
    if not isinstance(spec, str) and not spec:
        return ()  # an empty list: as "none"
    names = [n.strip() for n in (spec.split(",") if isinstance(spec, str) else spec)]
    if not names or any(not n for n in names):
        raise PlacementError("devices", "no devices specified", draft)
    if names == ["none"]:
        return ()
    if "none" in names:
        raise PlacementError("devices", "'none' stands alone (no offloading)", draft)
    return tuple(names)


def _parse_tensor_split(spec: str | Sequence[float] | None) -> tuple[float, ...]:
    if spec is None:
        return ()
    parts = re.split(r"[,/]+", spec) if isinstance(spec, str) else list(spec)
    ensure_backend()
    if len(parts) >= lib.llama_max_devices():
        raise PlacementError("tensor_split", f"{len(parts)} proportions, llama.cpp takes fewer than "
                             f"{lib.llama_max_devices()}")
    out = []
    for p in parts:
        try:
            v = float(p)
        except (TypeError, ValueError):
            raise PlacementError("tensor_split", f"{p!r} is not a number") from None
        if not math.isfinite(v) or v < 0:
            raise PlacementError("tensor_split", f"proportions are numbers >= 0, not {p!r}")
        out.append(v)
    return tuple(out)


# -- one model's placement --------------------------------------------------------------


@dataclass(frozen=True)
class Placement:
    """What ``llama_model_params`` carries about where a model goes, beyond the number
    of layers offloaded (``n_gpu_layers``) and memory mapping.

    ``override_tensor``: ``(pattern, buffer type)`` pairs, first match wins;
    ``devices``: device names to offload to, ``()`` for none, None for llama.cpp's
    choice (every GPU); ``split_mode``, ``tensor_split``, ``main_gpu``: as ``-sm``,
    ``-ts``, ``-mg``. ``draft`` only changes how errors name the options."""

    override_tensor: tuple[tuple[str, str], ...] = ()
    devices: tuple[str, ...] | None = None
    split_mode: str = "layer"
    tensor_split: tuple[float, ...] = ()
    main_gpu: int = 0
    draft: bool = False

    @classmethod
    def of(cls, *, override_tensor: str | Iterable[str | tuple[str, str]] | None = None, cpu_moe: bool = False,
           n_cpu_moe: int = 0, devices: str | Sequence[str] | None = None, split_mode: str = "layer",
           tensor_split: str | Sequence[float] | None = None, main_gpu: int = 0,
           draft: bool = False) -> "Placement":
        """From the options as llama-server takes them (strings or lists); the
        overrides in llama-server's order when all come at once: ``-ot``'s, then
        ``-cmoe``'s, then ``-ncmoe``'s. Raises PlacementError naming a bad one."""
        overrides = parse_overrides(override_tensor, draft) + moe_overrides(cpu_moe, n_cpu_moe, draft)
        if split_mode not in SPLIT_MODES:
            raise PlacementError("split_mode", f"{split_mode!r} is not one of {', '.join(SPLIT_MODES)}")
        if isinstance(main_gpu, bool) or not isinstance(main_gpu, int):
            raise PlacementError("main_gpu", f"a device index, not {main_gpu!r}")
        return cls(tuple(overrides), _parse_devices(devices, draft), split_mode, _parse_tensor_split(tensor_split),
                   main_gpu, draft)

    def check_names(self, extra_devices: Sequence = (), *, defer_rpc: bool = False) -> None:
        """PlacementError for a buffer type or a device no device of this process has
        (``defer_rpc``: names of RPC servers' devices are left to the load, when the
        servers are connected)."""
        bufts = _buffer_types(extra_devices)
        for _, name in self.override_tensor:
            if name not in bufts and not (defer_rpc and name.startswith("RPC")):
                raise PlacementError("override_tensor", f"unknown buffer type {name!r} (available: "
                                     f"{', '.join(sorted(bufts)) or 'none'})", self.draft)
        offload = _offload_by_name(extra_devices)
        for name in self.devices or ():
            if name.lower() not in offload and not (defer_rpc and name.upper().startswith("RPC")):
                raise PlacementError("devices", f"invalid device {name!r} (available: "
                                     f"{', '.join(device_names(extra_devices)) or 'none on this build'})", self.draft)

    def apply(self, params: Any, rpc_devices: Sequence = ()) -> list[Any]:
        """Fill ``llama_model_params``; ``rpc_devices``: the model's RPC servers'
        devices, which ``devices`` and the buffer types may name. Returns the cffi
        memory the parameters point into: keep it alive as long as the model."""
        self.check_names(rpc_devices)
        keep: list[Any] = []
        if self.override_tensor:
            bufts = _buffer_types(rpc_devices)
            arr = ffi.new("struct llama_model_tensor_buft_override[]", len(self.override_tensor) + 1)
            for i, (pattern, name) in enumerate(self.override_tensor):
                s = ffi.new("char[]", pattern.encode())
                keep.append(s)
                arr[i].pattern = s
                arr[i].buft = bufts[name]
            arr[len(self.override_tensor)].pattern = ffi.NULL  # the terminator
            keep.append(arr)
            params.tensor_buft_overrides = arr
        if self.devices is not None:
            offload = _offload_by_name(rpc_devices)
            devs = ffi.new("ggml_backend_dev_t[]", [offload[n.lower()] for n in self.devices] + [ffi.NULL])
            keep.append(devs)
            params.devices = devs
        params.split_mode = getattr(lib, f"LLAMA_SPLIT_MODE_{self.split_mode.upper()}")
        params.main_gpu = self.main_gpu
        if self.tensor_split:
            ts = ffi.new("float[]", lib.llama_max_devices())
            ts[0:len(self.tensor_split)] = list(self.tensor_split)
            keep.append(ts)
            params.tensor_split = ts
        return keep


# -- NUMA ----------------------------------------------------------------------------------

_numa_lock = threading.Lock()
_numa: str | None = None


def numa_init(strategy: str | None) -> None:
    """ggml's NUMA strategy for this process (llama-server's ``--numa``): set by the
    first call, before the first model's load; a later call asking for another one is
    a PlacementError (ggml keeps the first)."""
    global _numa
    if strategy is None:
        return
    if strategy not in NUMA_STRATEGIES:
        raise PlacementError("numa", f"{strategy!r} is not one of {', '.join(NUMA_STRATEGIES)}")
    ensure_backend()
    with _numa_lock:
        if _numa is None:
            lib.llama_numa_init(getattr(lib, f"GGML_NUMA_STRATEGY_{strategy.upper()}"))
            _numa = strategy
        elif _numa != strategy:
            raise PlacementError("numa", f"this process already runs with NUMA strategy {_numa!r} (ggml sets "
                                 "it once per process)")
