"""The generation threads: one per slot of the engine, off the event loop.

Requests become ``Job``s in a FIFO queue. Each of the ``engine.n_parallel`` worker
threads takes a job and runs its ``Engine.stream`` generator, handing what it
yields to the event loop through a ``Channel``; the engine batches the threads'
generations into the same decodes (``stepmtp.slots``). A job cancelled by its
client (``Job.cancel``, e.g. on a disconnect) is stopped at its next token and its
generator is closed right there, in its worker thread, so its slot is freed at once
(never left to the garbage collector).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from ..engine import Chunk, Completion, Engine
from ..slots import Cancelled
from ..sampling import SamplingParams

log = logging.getLogger("stepmtp.server")

__all__ = ["GenRequest", "Job", "Worker", "Channel", "Cancelled"]


class Channel:
    """Items from the worker thread to one coroutine of the event loop.

    ``put`` never blocks and wakes the loop only when the channel was empty, so a
    consumer that falls behind gets the tokens in batches rather than paying one
    loop wake-up per token.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._items: deque[tuple[str, Any]] = deque()
        self._lock = threading.Lock()
        self._event = asyncio.Event()

    def put(self, kind: str, payload: Any = None) -> None:  # worker thread
        with self._lock:
            wake = not self._items
            self._items.append((kind, payload))
        if wake:
            try:
                self._loop.call_soon_threadsafe(self._event.set)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

    def get_nowait(self) -> list[tuple[str, Any]]:  # event loop
        """Everything put so far, perhaps nothing."""
        with self._lock:
            items = list(self._items)
            self._items.clear()
            self._event.clear()
            return items

    async def get(self) -> list[tuple[str, Any]]:  # event loop
        """Everything put so far (waits for at least one item)."""
        while True:
            with self._lock:
                if self._items:
                    items = list(self._items)
                    self._items.clear()
                    self._event.clear()
                    return items
                self._event.clear()
            await self._event.wait()


@dataclass
class GenRequest:
    """One generation, ready to run: tokens in, every setting resolved."""

    prompt_tokens: list[int]
    n_predict: int
    stop: list[str]
    sampling: SamplingParams
    #: post every chunk (streaming) or only the result
    stream: bool
    #: reuse the slot's cached prefix (llama-server's cache_prompt)
    cache_prompt: bool = True


_ids = itertools.count()


@dataclass
class Job:
    request: GenRequest
    channel: Channel
    id: int = field(default_factory=lambda: next(_ids))
    cancelled: threading.Event = field(default_factory=threading.Event)
    t_queued: float = field(default_factory=time.perf_counter)

    def cancel(self) -> None:
        """Stop the job (it is skipped if still queued); safe from any thread, any time."""
        self.cancelled.set()


class Worker:
    """Runs jobs on ``engine`` in ``engine.n_parallel`` threads, started in the order
    submitted.

    ``on_done(job, completion_or_None, error_or_None, tokens_seen)`` runs in the
    worker thread after every job that started (metrics hook).
    """

    def __init__(self, engine: Engine, on_done: Callable[..., None] | None = None,
                 on_start: Callable[[Job], None] | None = None) -> None:
        self.engine = engine
        self.on_done = on_done
        self.on_start = on_start
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self.running: dict[int, Job] = {}
        self._stopping = False
        n = engine.n_parallel
        self._threads = [threading.Thread(target=self._loop, name=f"stepmtp-slot-{i}", daemon=True)
                         for i in range(n)]
        for t in self._threads:
            t.start()

    @property
    def n_waiting(self) -> int:
        return self._jobs.qsize()

    @property
    def n_running(self) -> int:
        return len(self.running)


    def submit(self, job: Job) -> None:
        if self._stopping:
            raise RuntimeError("the server is shutting down")
        self._jobs.put(job)

    def cancel_all(self, reason: str = "the server is shutting down") -> None:
        """Refuse new jobs, cancel the running one, drop the waiting ones (each is told why)."""
        self._stopping = True
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel()
                job.channel.put("error", Cancelled(reason))
        for cur in list(self.running.values()):
            cur.cancel()

    def stop(self, timeout: float = 10.0) -> bool:
        """``cancel_all``, then end the threads; True when they ended."""
        self.cancel_all()
        for _ in self._threads:
            self._jobs.put(None)
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)

    # -- the thread -------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if job.cancelled.is_set():
                job.channel.put("error", Cancelled("cancelled while queued"))
                continue
            self.running[job.id] = job
            try:
                self._run(job)
            finally:
                self.running.pop(job.id, None)

    def _run(self, job: Job) -> None:
        req = job.request
        result: Completion | None = None
        error: BaseException | None = None
        n_seen = 0
        if self.on_start is not None:
            self.on_start(job)
        try:
            gen = self.engine.stream(req.prompt_tokens, n_predict=req.n_predict, stop=req.stop,
                                     sampling=req.sampling, cache_prompt=req.cache_prompt)
        except BaseException as e:  # noqa: BLE001 - reported to the request
            error = e
        else:
            try:
                while True:
                    if job.cancelled.is_set():
                        error = Cancelled("the server is shutting down" if self._stopping else "cancelled")
                        break
                    try:
                        chunk: Chunk = next(gen)
                    except StopIteration as done:
                        result = done.value
                        break
                    n_seen += len(chunk.tokens)
                    if req.stream:
                        job.channel.put("chunk", chunk)
            except BaseException as e:  # noqa: BLE001
                error = e
            finally:
                gen.close()  # releases the engine's lock now, in this thread
        if error is not None and not isinstance(error, Cancelled):
            log.error("generation failed: %s: %s", type(error).__name__, error)
        if self.on_done is not None:
            try:
                self.on_done(job, result, error, n_seen)
            except Exception:  # noqa: BLE001 - metrics must not break serving
                log.exception("metrics update failed")
        if error is not None:
            job.channel.put("error", error)
        else:
            job.channel.put("done", result)
