"""Chat templates rendered in worker processes, bounded in time, output and memory.

A template comes from the model file, a flag or (through its variables) a request;
rendering runs arbitrary loops. In the server it runs here: in a small process of
its own (``jinja_render.py`` as a script, no llama.cpp, no model) with an address
space limit, answering within ``timeout`` seconds or killed. A template that loops
forever, builds a gigantic string or crashes costs one worker, which is replaced;
the server's event loop, its generations and its other requests go on.
"""
from __future__ import annotations

import json
import os
import queue
import select
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from .errors import ChatTemplateError

__all__ = ["TemplateSandbox"]

_SCRIPT = Path(__file__).with_name("jinja_render.py")


class _Worker:
    def __init__(self, max_memory: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-I", str(_SCRIPT), str(max_memory)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            bufsize=0, close_fds=True,
        )
        self._buf = b""

    def ask(self, payload: bytes, deadline: float) -> dict[str, Any] | None:
        """The worker's answer, or None when it did not answer in time or died."""
        try:
            self.proc.stdin.write(payload)
            self.proc.stdin.flush()
        except OSError:
            return None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                return None
            data = os.read(fd, 1 << 20)
            if not data:
                return None
            self._buf += data
        line, _, self._buf = self._buf.partition(b"\n")
        return json.loads(line)

    def kill(self) -> None:
        try:
            self.proc.kill()
            self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            pass


class TemplateSandbox:
    """Renders templates in up to ``n_workers`` worker processes (started when first
    needed, kept for the next renders). Each render: at most ``timeout`` seconds, at
    most ``max_chars`` characters of output, the worker at most ``max_memory`` bytes
    of address space. Past a bound, ``ChatTemplateError`` saying which."""

    def __init__(self, *, n_workers: int = 2, timeout: float = 5.0, max_chars: int = 4 << 20,
                 max_memory: int = 1 << 30) -> None:
        self.timeout = timeout
        self.max_chars = max_chars
        self.max_memory = max_memory
        self._idle: queue.LifoQueue[_Worker] = queue.LifoQueue()
        self._slots = threading.BoundedSemaphore(n_workers)
        self._lock = threading.Lock()
        self._all: set[_Worker] = set()
        self._closed = False

    def render(self, source: str, context: dict[str, Any]) -> str:
        return self._render(source, context, False)["ok"]

    def probe(self, source: str, context: dict[str, Any]) -> tuple[bool, set[str]]:
        """Whether the template renders ``context``, and what it read of the messages
        and tools, up to where it failed if it did (the paths ``jinja_render.render``
        records for a capability probe)."""
        try:
            reply = self._render(source, context, True)
        except ChatTemplateError:
            return False, set()
        return "ok" in reply, set(reply.get("used") or ())

    def _render(self, source: str, context: dict[str, Any], track: bool) -> dict[str, Any]:
        try:
            payload = (json.dumps({"source": source, "context": context, "max_chars": self.max_chars,
                                   "track": track}, ensure_ascii=True) + "\n").encode()
        except (TypeError, ValueError) as e:
            raise ChatTemplateError(f"chat template input is not JSON: {e}") from None
        deadline = time.monotonic() + self.timeout
        if not self._slots.acquire(timeout=self.timeout):
            raise ChatTemplateError(f"chat template: no renderer free within {self.timeout:g} s")
        try:
            w = self._take()
            reply = w.ask(payload, deadline)
            if reply is None:
                # stuck, over its memory limit, or dead: it goes, a fresh one replaces it
                dead = w.proc.poll() is not None
                self._discard(w)
                if dead:
                    raise ChatTemplateError("chat template: the renderer failed (out of memory?)")
                raise ChatTemplateError(f"chat template: rendering took longer than {self.timeout:g} s")
            self._idle.put(w)
        finally:
            self._slots.release()
        if "ok" in reply or track:
            return reply
        raise ChatTemplateError(reply.get("error") or "chat template failed")

    def _take(self) -> _Worker:
        while True:
            try:
                w = self._idle.get_nowait()
            except queue.Empty:
                break
            if w.proc.poll() is None:
                return w
            self._discard(w)
        with self._lock:
            if self._closed:
                raise ChatTemplateError("the template renderer is closed")
            w = _Worker(self.max_memory)
            self._all.add(w)
            return w

    def _discard(self, w: _Worker) -> None:
        w.kill()
        with self._lock:
            self._all.discard(w)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            workers, self._all = list(self._all), set()
        for w in workers:
            w.kill()
