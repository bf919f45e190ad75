"""The server's log as llama-server's --log-* and -lv flags set it: where it goes
(stderr, --log-file, --log-disable), how a line looks (--log-timestamps, --log-prefix,
--log-colors, --log-jsonl) and what is kept (-lv, -v)."""
from __future__ import annotations

import json
import logging
import sys
from typing import Any

#: -lv's levels (llama.cpp's: 0 output, 1 error, 2 warning, 3 info, 4 trace, 5 debug)
LEVELS = {0: logging.CRITICAL, 1: logging.ERROR, 2: logging.WARNING, 3: logging.INFO, 4: logging.DEBUG,
          5: logging.DEBUG}
_COLORS = {"DEBUG": "\033[90m", "INFO": "", "WARNING": "\033[33m", "ERROR": "\033[31m", "CRITICAL": "\033[31m"}


def level(lc: Any, verbose: bool) -> int:
    """The root logger's level: -v shows everything, as llama-server's."""
    if verbose:
        return logging.DEBUG
    return LEVELS.get(lc.verbosity, logging.DEBUG if lc.verbosity > 5 else logging.CRITICAL)


class _Line(logging.Formatter):
    def __init__(self, lc: Any, colors: bool) -> None:
        super().__init__()
        self.lc, self.colors = lc, colors

    def format(self, record: logging.LogRecord) -> str:
        parts = []
        if self.lc.timestamps:
            parts.append(self.formatTime(record, "%H:%M:%S"))
        if self.lc.prefix:
            lv = record.levelname[:5]
            if self.colors and _COLORS.get(record.levelname):
                lv = f"{_COLORS[record.levelname]}{lv}\033[0m"
            parts.append(f"{lv:5s} {record.name}:")
        parts.append(record.getMessage())
        line = " ".join(parts)
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class _Json(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        obj = {"time": record.created, "level": record.levelname.lower(), "logger": record.name,
               "message": record.getMessage()}
        if record.exc_info:
            obj["exception"] = self.formatException(record.exc_info)
        return json.dumps(obj, ensure_ascii=False)


def handlers(lc: Any) -> list[logging.Handler]:
    """stderr's handler (none with --log-disable) and --log-file's."""
    out: list[logging.Handler] = []
    if not lc.disable:
        h = logging.StreamHandler(sys.stderr)
        tty = hasattr(sys.stderr, "isatty") and sys.stderr.isatty()
        h.setFormatter(_Json() if lc.jsonl else _Line(lc, tty if lc.colors is None else lc.colors))
        out.append(h)
    if lc.file:
        f = logging.FileHandler(lc.file, encoding="utf-8")
        f.setFormatter(_Json() if lc.jsonl else _Line(lc, False))
        out.append(f)
    if not out:
        out.append(logging.NullHandler())
    return out
