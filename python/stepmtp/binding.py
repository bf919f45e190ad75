"""The cffi binding: the compiled ``_ffi`` module, llama.cpp's log, and its errors.

Everything else in stepmtp reaches llama.cpp through ``lib`` and ``ffi`` from here.
cffi (API mode) releases the GIL around every C call, so a decode in one thread does
not stall the others.
"""
from __future__ import annotations

import json
import logging
import threading
from collections import deque
from importlib import resources
from typing import Any

try:
    from . import _ffi  # type: ignore[attr-defined]
except ImportError as e:  # pragma: no cover - only without a build
    raise ImportError(
        "stepmtp's compiled extension is missing: install the package with "
        "`pip install .` (it builds the patched llama.cpp) instead of importing the "
        f"source tree ({e})"
    ) from e

ffi = _ffi.ffi
lib = _ffi.lib

#: llama.cpp's log, as Python logging. Silent unless the application configures
#: logging (e.g. ``logging.basicConfig(level=logging.INFO)``).
log = logging.getLogger("stepmtp.llama")
log.addHandler(logging.NullHandler())
log.propagate = True

_LEVELS = {
    lib.GGML_LOG_LEVEL_DEBUG: logging.DEBUG,
    lib.GGML_LOG_LEVEL_INFO: logging.INFO,
    lib.GGML_LOG_LEVEL_WARN: logging.WARNING,
    lib.GGML_LOG_LEVEL_ERROR: logging.ERROR,
}


class LlamaError(RuntimeError):
    """A llama.cpp call failed; the message carries what llama.cpp said about it."""


class _LogState:
    """Assembles llama.cpp's log fragments into lines and keeps recent errors.

    llama.cpp logs a line in pieces (GGML_LOG_LEVEL_CONT continues the previous
    one); errors are remembered so a failing call can be turned into an exception
    that says why.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.partial = ""
        self.level = logging.INFO
        self.errors: deque[tuple[int, str]] = deque(maxlen=64)
        self.n_errors = 0

    def feed(self, level: int, text: str) -> None:
        with self.lock:
            if level != lib.GGML_LOG_LEVEL_CONT:
                if self.partial:
                    self._emit(self.partial)
                self.partial = ""
                self.level = _LEVELS.get(level, logging.INFO)
            self.partial += text
            if self.partial.endswith("\n"):
                self._emit(self.partial)
                self.partial = ""

    def _emit(self, line: str) -> None:
        line = line.rstrip("\n")
        if self.level >= logging.WARNING:
            self.n_errors += 1
            self.errors.append((self.n_errors, line))
        if log.isEnabledFor(self.level):
            log.log(self.level, "%s", line)

    def mark(self) -> int:
        with self.lock:
            return self.n_errors

    def since(self, mark: int) -> list[str]:
        with self.lock:
            if self.partial and self.level >= logging.WARNING:
                self._emit(self.partial)
                self.partial = ""
            return [line for n, line in self.errors if n > mark]


_log_state = _LogState()


@ffi.def_extern()
def stepmtp_log_cb(level: int, text: Any, user_data: Any) -> None:
    try:
        _log_state.feed(level, ffi.string(text).decode("utf-8", "replace"))
    except Exception:  # never let an exception cross into C
        pass


class ErrorCapture:
    """Collects llama.cpp's warnings and errors logged while a block runs.

    >>> with ErrorCapture() as cap:
    ...     ptr = lib.llama_model_load_from_file(...)
    >>> if ptr == ffi.NULL: raise LlamaError(cap.message("cannot load"))
    """

    def __enter__(self) -> "ErrorCapture":
        self._mark = _log_state.mark()
        return self

    def __exit__(self, *exc: object) -> None:
        pass  # the lines are gathered only when a message is asked for (a failure)

    def message(self, what: str) -> str:
        lines = _log_state.since(self._mark)
        # the most specific reason is usually the first error logged
        detail = "; ".join(dict.fromkeys(line.strip() for line in lines if line.strip()))
        return f"{what}: {detail}" if detail else what


_init_lock = threading.Lock()
_initialized = False


def ensure_backend() -> None:
    """Initialise llama.cpp once per process, with its log routed to Python."""
    global _initialized
    if _initialized:
        return
    with _init_lock:
        if not _initialized:
            lib.llama_log_set(lib.stepmtp_log_cb, ffi.NULL)
            lib.llama_backend_init()
            _initialized = True


def build_info() -> dict[str, Any]:
    """What the build recorded about itself (flags, compiler, vendored tree)."""
    try:
        text = resources.files(__package__).joinpath("_build_info.json").read_text()
        return json.loads(text)
    except (OSError, ValueError):
        return {}


def llama_cpp_commit() -> str | None:
    """The vendored llama.cpp's upstream commit, from the manifest installed beside the
    package (an editable install runs from the source tree: vendor/manifest.json)."""
    from pathlib import Path

    here = Path(__file__).resolve().parent
    for manifest in (here / "_vendor_manifest.json", here.parents[1] / "vendor" / "manifest.json"):
        if manifest.exists():
            return json.loads(manifest.read_text()).get("upstream_commit")
    return None
