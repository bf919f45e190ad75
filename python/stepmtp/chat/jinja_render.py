"""Rendering a chat template with jinja2: the environment the ecosystem uses (a
sandboxed, immutable jinja2 environment with ``raise_exception`` and
``strftime_now``, blocks trimmed) and an output bound.

This file imports nothing from stepmtp, so that ``sandbox.py`` can run it as a
script in a small process of its own (``python -I jinja_render.py``): there a
template that loops forever or allocates without bound is killed or runs out of
its memory limit, and the server goes on. Protocol on stdin/stdout: one JSON
object per line each way, ``{"source", "context", "max_chars"}`` in,
``{"ok": text}`` or ``{"error": message, "kind": ...}`` out.
"""
from __future__ import annotations

import datetime
import json
import sys
from functools import lru_cache
from typing import Any


class TemplateFailure(Exception):
    """The template is invalid, raised an exception, or produced too much."""

    def __init__(self, message: str, kind: str = "template") -> None:
        super().__init__(message)
        self.kind = kind


def _raise(message: str) -> None:
    raise TemplateFailure(str(message))


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False,
            separators: Any = None) -> str:
    # HF/minja's tojson: not HTML-escaped (jinja2's own escapes < > & ')
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys,
                      separators=tuple(separators) if separators else None)


@lru_cache(maxsize=16)
def compile_template(source: str):  # noqa: ANN201 - a jinja2 Template
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    env.filters["tojson"] = _tojson
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise TemplateFailure(f"invalid chat template: {e}") from e


def render(source: str, context: dict[str, Any], max_chars: int = 0) -> str:
    """The template's output for ``context``; past ``max_chars`` characters (0: no
    bound) a TemplateFailure of kind "size"."""
    from jinja2 import TemplateError

    tpl = compile_template(source)
    parts: list[str] = []
    n = 0
    try:
        for piece in tpl.generate(**context):
            n += len(piece)
            if max_chars and n > max_chars:
                raise TemplateFailure(f"the rendered prompt exceeds {max_chars} characters", "size")
            parts.append(piece)
    except TemplateFailure:
        raise
    except TemplateError as e:
        raise TemplateFailure(f"chat template failed: {e}") from e
    except RecursionError:
        raise TemplateFailure("chat template failed: too deeply nested") from None
    except MemoryError:
        raise TemplateFailure("chat template failed: out of memory", "size") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ArithmeticError) as e:
        raise TemplateFailure(f"chat template failed: {type(e).__name__}: {e}") from e
    return "".join(parts)


def serve(max_memory: int) -> None:
    """The worker's loop (see the module's docstring)."""
    if max_memory > 0:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (max_memory, max_memory))
    out = sys.stdout
    for line in sys.stdin:
        try:
            req = json.loads(line)
            text = render(req["source"], req["context"], int(req.get("max_chars", 0)))
            reply: dict[str, Any] = {"ok": text}
        except TemplateFailure as e:
            reply = {"error": str(e), "kind": e.kind}
        except MemoryError:
            reply = {"error": "chat template failed: out of memory", "kind": "size"}
        except Exception as e:  # noqa: BLE001 - whatever a template does, the worker answers
            reply = {"error": f"chat template failed: {type(e).__name__}: {e}", "kind": "template"}
        try:
            data = json.dumps(reply, ensure_ascii=True)
        except MemoryError:
            data = json.dumps({"error": "chat template failed: out of memory", "kind": "size"})
        out.write(data + "\n")
        out.flush()


if __name__ == "__main__":
    serve(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
