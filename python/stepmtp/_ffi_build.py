"""Emit the C source of stepmtp's cffi extension (API mode).

Run by CMake at build time: ``python _ffi_build.py OUT.c``. The declarations live in
``decl/*.h`` (joined in a fixed order); the generated module includes the real
llama.cpp headers, so the C compiler checks every signature against them.
"""
from __future__ import annotations

import sys
from pathlib import Path

import cffi

DECL = Path(__file__).resolve().parent / "decl"
# order matters: later files use the types of earlier ones
DECL_FILES = ("ggml-backend.h", "llama.h", "llama-mtp.h", "callbacks.h")

SOURCE = """
#include "ggml-backend.h"
#include "ggml-rpc.h"
#include "llama.h"
#include "llama-mtp.h"
"""


def make_ffi() -> cffi.FFI:
    ffi = cffi.FFI()
    ffi.cdef("\n".join((DECL / name).read_text() for name in DECL_FILES))
    ffi.set_source("stepmtp._ffi", SOURCE)
    return ffi


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: _ffi_build.py OUT.c", file=sys.stderr)
        return 2
    out = Path(argv[1])
    make_ffi().emit_c_code(str(out) + ".tmp")
    # keep the old file (and its timestamp) when nothing changed: no needless rebuild
    new = Path(str(out) + ".tmp").read_text()
    if not out.exists() or out.read_text() != new:
        out.write_text(new)
    Path(str(out) + ".tmp").unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
