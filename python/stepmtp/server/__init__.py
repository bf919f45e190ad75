"""``python -m stepmtp.server``: a llama-server-compatible HTTP endpoint over stepmtp.

Started with llama-server's flags (``cli``), it serves llama-server's routes and
JSON shapes (``app``, ``formats``, ``schemas``), one router per API family
(``routes``) over one generation service (``service``), from one ``Engine`` run in
a worker thread (``worker``), with llama-server's Prometheus metrics plus the MTP
heads' (``metrics``).

    python -m stepmtp.server -m model.gguf --spec-type draft-mtp --port 8080

In code: ``create_app(ServerConfig(model=...))`` is an ASGI app.
"""
from __future__ import annotations

from .config import ServerConfig

__all__ = ["ServerConfig", "create_app", "main"]


def create_app(*args, **kwargs):  # noqa: ANN002, ANN003, ANN201 - see app.create_app
    from .app import create_app as _create_app

    return _create_app(*args, **kwargs)


def main(argv=None) -> int:  # noqa: ANN001
    from .cli import main as _main

    return _main(argv)
