"""The value types of the server's flags, shared by ``cli`` (our flags and the common
ones) and ``flags`` (the rest of llama-server's table): errors name the flag through
argparse, as llama-server's messages do."""
from __future__ import annotations

import argparse
from typing import Any, Callable


class ArgError(Exception):
    pass


def _int(v: str) -> int:
    try:
        return int(v, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {v!r}") from None


def _float(v: str) -> float:
    try:
        return float(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {v!r}") from None


def _on_off_auto(v: str) -> bool | None:
    low = v.lower()
    if low in ("on", "enabled", "true", "1", "yes"):
        return True
    if low in ("off", "disabled", "false", "0", "no"):
        return False
    if low == "auto":
        return None
    raise argparse.ArgumentTypeError(f"expected on, off or auto, got {v!r}")


def _json_object(v: str) -> dict[str, Any]:
    import json

    try:
        obj = json.loads(v)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return obj


def _on_off(v: str) -> bool:
    if v.lower() in ("on", "1", "true", "enabled"):
        return True
    if v.lower() in ("off", "0", "false", "disabled"):
        return False
    raise argparse.ArgumentTypeError(f"expected on or off, got {v!r}")


def _choice(*allowed: str) -> Callable[[str], str]:
    def check(v: str) -> str:
        if v not in allowed:
            raise argparse.ArgumentTypeError(f"expected one of {', '.join(allowed)}, got {v!r}")
        return v
    return check
