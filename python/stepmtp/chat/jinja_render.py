"""Rendering a chat template with jinja2: the environment the ecosystem uses (a
sandboxed, immutable jinja2 environment with ``raise_exception`` and
``strftime_now``, blocks trimmed) and an output bound.

This file imports nothing from stepmtp, so that ``sandbox.py`` can run it as a
script in a small process of its own (``python -I jinja_render.py``): there a
template that loops forever or allocates without bound is killed or runs out of
its memory limit, and the server goes on. Protocol on stdin/stdout: one JSON
object per line each way, ``{"source", "context", "max_chars", "track"}`` in,
``{"ok": text, "used": [...]}`` or ``{"error": message, "kind": ...}`` out.

``track`` (a capability probe): the messages and tools are wrapped so that what the
template reads of them is recorded, as llama.cpp's template engine records a value's
use: ``used`` lists the paths read (``messages[1].tool_calls[0].function``) and the
operations applied (``messages[0].content#array_access``, ``#selectattr``).
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
    _read_all(value)  # a probe: serialising reads every value
    # HF/minja's tojson: not HTML-escaped (jinja2's own escapes < > & ')
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys,
                      separators=tuple(separators) if separators else None)


def _wrap(v: Any, path: str, used: set[str]) -> Any:
    """``v`` as a probe's value: what the template reads of it goes into ``used``."""
    if isinstance(v, dict):
        return _TDict(v, path, used)
    if isinstance(v, list):
        return _TList(v, path, used)
    if isinstance(v, str):
        return _TStr(v, path, used)
    return v


def _read_all(v: Any) -> None:
    if isinstance(v, _TDict):
        v.values()
        for x in dict.values(v):
            _read_all(x)
    elif isinstance(v, _TList):
        for x in v:
            _read_all(x)


class _TDict(dict):
    def __init__(self, d: dict, path: str, used: set[str]) -> None:
        super().__init__({k: _wrap(x, f"{path}.{k}", used) for k, x in d.items()})
        self._path, self._used = path, used

    def __getitem__(self, k: Any) -> Any:
        self._used.add(f"{self._path}.{k}")
        return super().__getitem__(k)

    def get(self, k: Any, default: Any = None) -> Any:
        if k in self:
            self._used.add(f"{self._path}.{k}")
        return super().get(k, default)

    def items(self):  # noqa: ANN201 - iterating a mapping reads every value
        self._used.update(f"{self._path}.{k}" for k in self)
        return super().items()

    def values(self):  # noqa: ANN201
        self._used.update(f"{self._path}.{k}" for k in self)
        return super().values()


class _TList(list):
    def __init__(self, items: list, path: str, used: set[str]) -> None:
        super().__init__(_wrap(x, f"{path}[{i}]", used) for i, x in enumerate(items))
        self._path, self._used = path, used

    def __getitem__(self, i: Any) -> Any:
        self._used.add(f"{self._path}#array_access")
        return super().__getitem__(i)


class _TStr(str):
    def __new__(cls, s: str, path: str, used: set[str]) -> "_TStr":
        obj = super().__new__(cls, s)
        obj._path, obj._used = path, used
        return obj

    def __getitem__(self, i: Any) -> str:
        self._used.add(f"{self._path}#array_access")
        return str.__getitem__(self, i)


def _selectattr_tracking(env):  # noqa: ANN001, ANN202 - jinja2's filter, recording what it filters
    base = env.filters["selectattr"]

    def selectattr(context, value, *args, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        if isinstance(value, (_TList, _TStr)):
            value._used.add(f"{value._path}#selectattr")
        return base(context, value, *args, **kw)

    selectattr.jinja_pass_arg = base.jinja_pass_arg
    return selectattr


@lru_cache(maxsize=1)
def _undefined_class():  # noqa: ANN202 - a jinja2 Undefined class
    from jinja2 import ChainableUndefined
    from jinja2.exceptions import SecurityError

    class Undefined(ChainableUndefined):
        """A member of an undefined value is undefined, as in llama.cpp's template engine
        (``messages[0].role`` of no messages compares unequal instead of failing);
        what the sandbox refused stays an error."""

        __slots__ = ()

        def __getattr__(self, name: str) -> Any:
            if self._undefined_exception is SecurityError:
                self._fail_with_undefined_error()
            return super().__getattr__(name)

        def __getitem__(self, name: Any) -> Any:
            if self._undefined_exception is SecurityError:
                self._fail_with_undefined_error()
            return self

    return Undefined


@lru_cache(maxsize=16)
def compile_template(source: str, track: bool = False):  # noqa: ANN201 - a jinja2 Template
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=_undefined_class(),
                                        extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    env.filters["tojson"] = _tojson
    if track:
        env.filters["selectattr"] = _selectattr_tracking(env)
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise TemplateFailure(f"invalid chat template: {e}") from e


def render(source: str, context: dict[str, Any], max_chars: int = 0, used: set[str] | None = None) -> str:
    """The template's output for ``context``; past ``max_chars`` characters (0: no
    bound) a TemplateFailure of kind "size". ``used``: a probe, which gets the paths
    the template read of the messages and tools (see the module docstring)."""
    from jinja2 import TemplateError

    tpl = compile_template(source, used is not None)
    if used is not None:
        context = {**context, "messages": _wrap(context.get("messages") or [], "messages", used)}
        if context.get("tools") is not None:
            context["tools"] = _wrap(context["tools"], "tools", used)
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
        used: set[str] | None = None
        try:
            req = json.loads(line)
            used = set() if req.get("track") else None
            text = render(req["source"], req["context"], int(req.get("max_chars", 0)), used)
            reply: dict[str, Any] = {"ok": text}
            if used is not None:
                reply["used"] = sorted(used)
        except TemplateFailure as e:
            reply = {"error": str(e), "kind": e.kind}
            if used is not None:  # a probe: what the template read before it failed counts
                reply["used"] = sorted(used)
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
