"""The generation thread: one thread schedules every request on the engine.

Requests become ``Job``s in a FIFO queue. One scheduling thread submits them to the
engine (``Engine.submit``), steps it while any is running (``Engine.step``: one MTP
round for all generating slots, batched, and a prompt chunk), and hands each job's
chunks to the event loop through its ``Channel``. A job cancelled by its client
(``Job.cancel``, e.g. on a disconnect) is dropped after the current step, its slot
freed at once.

One thread, not one per slot: llama.cpp's CPU backend runs its graphs on an OpenMP
thread team owned by the calling thread. With a thread per slot taking turns, every
slot thread keeps a team; once there are more team threads than cores, libgomp
stops spinning at its barriers and sleeps at each of them (measured: 2-4x slower
per token with 4 slot threads, 2 llama.cpp threads, 2 cores).
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

from ..api.service import GenRequest
from ..engine import Chunk, Completion, Engine
from ..slots import Cancelled, Request

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

    @property
    def backlog(self) -> int:
        """Items put and not yet taken: how far the consumer is behind."""
        return len(self._items)

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


#: a stream whose client has not taken this many chunks is paused (its slot keeps its
#: place but sits out the rounds) until it has taken half of them: a client that
#: stops reading costs a bounded buffer, never the whole generation in memory
MAX_BACKLOG = 256


class Worker:
    """Runs jobs on ``engine`` from one scheduling thread, started in the order
    submitted, up to ``engine.n_parallel`` at once.

    ``on_done(job, completion_or_None, error_or_None, tokens_seen)`` runs in the
    worker thread after every job that started (metrics hook).
    """

    #: how long an idle engine waits for more requests after one arrives (seconds)
    GATHER_S = 0.005

    def __init__(self, engine: Engine, on_done: Callable[..., None] | None = None,
                 on_start: Callable[[Job], None] | None = None) -> None:
        self.engine = engine
        self.on_done = on_done
        self.on_start = on_start
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        #: submitted to the engine, not finished: job id -> (job, its engine request)
        self._active: dict[int, tuple[Job, Request]] = {}
        #: tokens handed to each active job's channel so far
        self._seen: dict[int, int] = {}
        #: jobs submitted that have no slot yet (queued here or in the engine)
        self._waiting: set[int] = set()
        self._wlock = threading.Lock()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="stepmtp-scheduler", daemon=True)
        self._thread.start()

    @property
    def n_waiting(self) -> int:
        return len(self._waiting)

    @property
    def n_running(self) -> int:
        return len(self.running())

    def running(self) -> list[Job]:
        """The jobs generating now, in a slot (safe from any thread)."""
        return [job for job, req in list(self._active.values()) if req.state.seq_id >= 0 and not req.done]

    def submit(self, job: Job) -> None:
        if self._stopping:
            raise RuntimeError("the server is shutting down")
        with self._wlock:
            self._waiting.add(job.id)
        self._jobs.put(job)

    def cancel_all(self, reason: str = "the server is shutting down") -> None:
        """Refuse new jobs, cancel the running ones, drop the waiting ones (each is told why)."""
        self._stopping = True
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                self._not_waiting(job.id)
                job.cancel()
                job.channel.put("error", Cancelled(reason))
        for job, _ in list(self._active.values()):
            job.cancel()

    def stop(self, timeout: float = 10.0) -> bool:
        """``cancel_all``, then end the thread; True when it ended."""
        self.cancel_all()
        self._jobs.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # -- the thread -------------------------------------------------------------

    def _loop(self) -> None:
        eng = self.engine
        while True:
            # wait for work only when there is nothing to step
            try:
                job = self._jobs.get(block=not self._active)
            except queue.Empty:
                job = False  # type: ignore[assignment]
            # an idle engine waits a moment for the requests sent with this one (an
            # agent's parallel calls, a batch of clients): their prompts then share
            # decodes from the first, where the first prompt went alone otherwise and the
            # others waited for it (four prompts sent at once: ~15% longer to prefill)
            gather_until = time.perf_counter() + self.GATHER_S if not self._active and job else 0.0
            while job is not False:
                if job is None:
                    self._cancel_active()
                    return
                self._start(job)
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    left = gather_until - time.perf_counter()
                    if left <= 0:
                        break
                    try:
                        job = self._jobs.get(timeout=left)
                    except queue.Empty:
                        break
            for job, req in list(self._active.values()):
                if job.cancelled.is_set() and not req.done:
                    eng.cancel(req)
                # back-pressure: a stream far behind its client sits out the rounds
                backlog = job.channel.backlog
                if backlog > MAX_BACKLOG:
                    req.paused = True
                elif req.paused and backlog <= MAX_BACKLOG // 2:
                    req.paused = False
            if eng.busy and not eng.slots.stalled:
                try:
                    eng.step()
                except BaseException as e:  # noqa: BLE001 - a bug or a closed engine: fail, go on
                    log.exception("engine step failed")
                    for job, req in list(self._active.values()):
                        eng.cancel(req)
                        req.fail(e)
            elif self._active:
                # every stream waits for its client: wait for a new job, or a while
                try:
                    job = self._jobs.get(timeout=0.005)
                except queue.Empty:
                    pass
                else:
                    if job is None:
                        self._cancel_active()
                        return
                    self._start(job)
            self._deliver()

    def _not_waiting(self, jid: int) -> None:
        with self._wlock:
            self._waiting.discard(jid)

    def _start(self, job: Job) -> None:
        if job.cancelled.is_set():
            self._not_waiting(job.id)
            job.channel.put("error", Cancelled("cancelled while queued"))
            return
        if self.on_start is not None:
            self.on_start(job)
        req = job.request
        try:
            handle = self.engine.submit(req.prompt_tokens, **req.engine_kwargs())
        except BaseException as e:  # noqa: BLE001 - reported to the request
            self._not_waiting(job.id)
            self._finish(job, None, e, 0)
            return
        self._active[job.id] = (job, handle)
        self._seen[job.id] = 0

    def _deliver(self) -> None:
        for jid, (job, req) in list(self._active.items()):
            if req.state.seq_id >= 0 or req.done:
                self._not_waiting(jid)
            while req.chunks:
                chunk: Chunk = req.chunks.popleft()
                self._seen[jid] += len(chunk.tokens)
                if job.request.stream:
                    job.channel.put("chunk", chunk)
            if req.done:
                del self._active[jid]
                n_seen = self._seen.pop(jid)
                error = req.error
                if isinstance(error, Cancelled) and self._stopping:
                    error = Cancelled("the server is shutting down")
                self._finish(job, req.completion if error is None else None, error, n_seen)

    def _finish(self, job: Job, result: Completion | None, error: BaseException | None, n_seen: int) -> None:
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

    def _cancel_active(self) -> None:
        for job, req in list(self._active.values()):
            self.engine.cancel(req)
        self._deliver()
