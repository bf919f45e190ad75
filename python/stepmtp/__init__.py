"""stepmtp: Step-3.5/3.7-Flash with its three MTP heads chained as speculative decoding.

A Python package over a patched, vendored llama.cpp, driven through cffi.
"""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version as _version

try:
    __version__ = _version("stepmtp")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0+unknown"

from .binding import LlamaError
from .llama import Batch, Context, Model, ModelLoadError, default_threads
from .mtp import SpecConfig
from .sampling import SamplingParams
from .budget import ReasoningBudget
from .stats import GenStats
from .engine import Chunk, Completion, Engine
from .rpc import RPCError, rpc_server_path
from .placement import PlacementError

__all__ = [
    "__version__",
    "system_info",
    "Model",
    "Context",
    "Batch",
    "LlamaError",
    "ModelLoadError",
    "RPCError",
    "PlacementError",
    "rpc_server_path",
    "default_threads",
    "Engine",
    "Completion",
    "Chunk",
    "SpecConfig",
    "SamplingParams",
    "ReasoningBudget",
    "GenStats",
]


def system_info() -> dict[str, object]:
    """What this build of stepmtp runs on: backend, build flags, llama.cpp commit and
    the patches applied to it."""
    from .binding import build_info, ensure_backend, ffi, lib, llama_cpp_commit
    from .placement import buffer_type_names
    from .rpc import _local_devices

    ensure_backend()
    info = build_info()
    vendor = info.get("vendor", {})
    return {
        "stepmtp": __version__,
        "llama_cpp_commit": llama_cpp_commit(),
        "sdist_sha256": vendor.get("sha256"),
        "patches": [name for name, _ in vendor.get("patches", [])],
        # true with the RPC backend alone: RPC servers count as GPUs for offloading
        "gpu_offload": bool(lib.llama_supports_gpu_offload()),
        # this machine's GPUs llama.cpp would offload to (none on a CPU build, RPC or not)
        "gpus": [ffi.string(lib.ggml_backend_dev_description(d)).decode() for d in _local_devices()],
        "rpc": lib.ggml_backend_reg_by_name(b"RPC") != ffi.NULL,
        # what -ot / override_tensor may name
        "buffer_types": buffer_type_names(),
        "backend": ffi.string(lib.llama_print_system_info()).decode(),
        "build_type": info.get("build_type"),
        "build_flags": [f for f in info.get("build_flags", "").split(";") if f],
        "compiler": info.get("compiler"),
    }
