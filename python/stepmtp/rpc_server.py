"""``python -m stepmtp.rpc_server [flags]``: the rpc-server built with this package.

It is llama.cpp's ``rpc-server`` (ggml's RPC backend serving this machine's devices
to a head process started with ``--rpc``), of the same llama.cpp version as the
head, which the protocol requires. Flags are rpc-server's own (``--help``):
``-H HOST -p PORT`` (default 127.0.0.1:50052), ``-t N`` CPU threads, ``-d DEV,...``
devices, ``-c`` keep received weights in a local cache.
"""
from __future__ import annotations

import os
import sys
from typing import Sequence

from .rpc import rpc_server_path


def main(argv: Sequence[str] | None = None) -> int:
    try:
        exe = rpc_server_path()
    except FileNotFoundError as e:
        print(f"python -m stepmtp.rpc_server: {e}", file=sys.stderr)
        return 1
    args = list(sys.argv[1:] if argv is None else argv)
    # exec: signals, the exit status and the terminal go straight to rpc-server
    os.execv(exe, [str(exe), *args])
    return 0  # pragma: no cover - execv does not return


if __name__ == "__main__":
    sys.exit(main())
