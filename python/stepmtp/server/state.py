"""The server's state: the engine, loaded in the background once the server listens,
the worker thread that runs it, and what the routes read about them (``ServerState``)."""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Callable

from ..api.errors import APIError
from ..api.service import API, SpecReport
from ..chat.sandbox import TemplateSandbox
from ..engine import Completion, Engine
from .config import ServerConfig
from .metrics import Metrics
from .worker import Cancelled, Job, Worker

log = logging.getLogger("stepmtp.server")


class ServerState:
    """The engine and everything around it, shared by the routes."""

    def __init__(self, cfg: ServerConfig, engine_factory: Callable[[Path], Engine] | None = None) -> None:
        self.cfg = cfg
        self.engine_factory = engine_factory or cfg.load_engine
        self.ready = threading.Event()
        self.failed: str | None = None
        self.engine: Engine | None = None
        self.worker: Worker | None = None
        self.metrics = Metrics()
        self.model_path: Path | None = None
        self.model_name = cfg.model_name() if cfg.model or cfg.aliases or cfg.hf_repo else "stepmtp-default"
        #: the request handling the routes share with ``Engine.create_chat_completion``
        self.api: API | None = None
        self.n_draft = 0
        self.memory: dict[str, dict[str, int]] = {}
        #: called (from the loading thread) when the model cannot be loaded: stops the server
        self.on_fatal: Callable[[], None] | None = None
        self.exit_code = 0
        self._closed = False
        #: chat templates render here: bounded in time, output and memory, off the event loop
        self.templates = TemplateSandbox(timeout=cfg.template_timeout, max_chars=cfg.template_max_chars)
        #: --sleep-idle-seconds: the engine is freed (``sleep``) and loaded again by the
        #: next request that needs it (``enter``); requests in flight keep it awake
        self.sleeping = False
        self.last_active = time.monotonic()
        self._in_flight = 0
        self._sleep_lock = threading.Lock()
        #: while asleep: the bodies of GET /props and /v1/models from before (by path)
        self.asleep_bodies: dict[str, dict] = {}
        self._asleep_scales: list[float] = []

    # -- loading ----------------------------------------------------------------

    def load(self) -> None:
        cfg = self.cfg
        try:
            cfg.fetch_models()  # -hf, -mu: fetched (or found in the cache) first
            path = cfg.model_path()
            self.model_path = path
            self.model_name = cfg.model_name(path)
            self._start_engine(path)
            self.last_active = time.monotonic()
            self.ready.set()
            log.info("server is listening on http://%s:%d - ready", _host_for_url(cfg.host), cfg.port)
        except BaseException as e:  # noqa: BLE001 - reported, then the server stops
            self.failed = f"{type(e).__name__}: {e}"
            self.exit_code = 1
            log.error("failed to load the model: %s", e)
            if self.on_fatal is not None:
                self.on_fatal()

    def _start_engine(self, path: Path) -> None:
        """Load the engine, and make what the routes use of it (at start, and when a
        request wakes the server)."""
        cfg = self.cfg
        log.info("loading model %s%s", path, f" (draft/MTP model {cfg.mtp_model})" if cfg.speculative
                 and cfg.mtp_model else "")
        t0 = time.perf_counter()
        engine = self.engine_factory(path)
        self.engine = engine
        m = engine.model
        self.api = API(engine, cfg, model_name=self.model_name, templates=self.templates,
                       mtp_mode=self.mtp_mode(),
                       spec=SpecReport(cfg.spec_types, cfg.mtp_mode, cfg.n_max, cfg.n_min, cfg.p_min))
        from ..grammar import vocabulary

        vocabulary(m)  # the grammar backend's view of the vocabulary: built once, at load
        self.templates.render("", {})  # a template worker started now, not on the first chat
        self.n_draft = engine.driver.n_draft
        log.info("model: %s (%s, %s parameters, %.1f MiB), n_ctx_train %d, loaded in %.2f s",
                 self.model_name, m.description, _si(m.n_params), m.size / 2**20, m.n_ctx_train,
                 time.perf_counter() - t0)
        src = f"from {cfg.mtp_model}" if cfg.speculative and cfg.mtp_model else "in the target file"
        if engine.draft_model is not None:
            log.info("MTP heads: %d found (%s)", engine.n_heads, src)
        else:
            log.info("MTP heads: %d/%d in the file, not used", m.n_mtp_blocks_loaded, m.n_mtp_blocks)
        if cfg.speculative:
            log.info("speculation: draft-mtp, mode %s, n_max %d (%d drafted per round), n_min %d, p_min %.2f",
                     cfg.mtp_mode, cfg.n_max, self.n_draft, cfg.n_min, cfg.p_min)
        if cfg.ngram_types or (cfg.speculative and cfg.spec_context):
            pool = (f"{cfg.context_pool} tokens of earlier requests kept per API key "
                    f"(~{cfg.context_pool * 160 / 2**20:.0f} MB)") if cfg.context_pool else "no pool"
            log.info("speculation from the context: %s; %s",
                     ", ".join([*cfg.ngram_types, *(["ours"] if cfg.speculative and cfg.spec_context else [])]),
                     pool)
        if not cfg.speculative and not cfg.ngram_types:
            log.info("speculation: none (--spec-type draft-mtp to draft with the MTP heads)")
        ad = getattr(engine, "adapters", None)
        for i, a in enumerate(ad.loras if ad else ()):
            log.info("LoRA adapter %d: %s, scale %g%s", i, a.path, a.scale,
                     " (not applied: --lora-init-without-apply)" if ad.scales[i] == 0 and a.scale else "")
        if ad is not None and ad.cvec is not None:
            log.info("control vector: %s, layers %d to %d", ", ".join(f"{p} x {x:g}" for p, x in cfg.control_vectors),
                     *ad.layer_range)
        if engine.target.batch_invariant:
            log.info("batch-invariant target: decodes of up to %d rows computed a row at a time, attention "
                     "over the whole KV cache", engine.target.batch_invariant)
        log.info("context: n_ctx %d, n_batch %d, n_ubatch %d", engine.n_ctx, engine.target.n_batch,
                 engine.target.n_ubatch)
        log.info("slots: %d, decoded together; n_ctx per slot %d (%s KV cache)", engine.n_parallel,
                 engine.n_ctx, "unified" if engine.target.kv_unified else "split")
        # llama.cpp's buffers: fixed once the contexts exist (the output buffer may grow)
        self.memory = engine.memory()
        mib = {k: {kk: v / 2**20 for kk, v in d.items()} for k, d in self.memory.items()}
        log.info("memory (MiB): target KV %.2f, compute %.2f; draft KV %.2f (%d heads, one layer each), "
                 "compute %.2f; sliding-window cache %s, %d context checkpoints per slot",
                 mib["target"]["kv"], mib["target"]["compute"], mib["draft"]["kv"],
                 sum(d is not None for d in engine.drafts), mib["draft"]["compute"],
                 "full" if engine.target.swa_full else "window + ubatch",
                 engine.driver.n_checkpoints)
        if cfg.warmup and hasattr(engine, "warmup"):
            t1 = time.perf_counter()
            engine.warmup()
            log.info("warmed up in %.2f s (--no-warmup: none)", time.perf_counter() - t1)
        self.worker = Worker(engine, on_done=self._on_done)

    # -- sleeping (--sleep-idle-seconds) -------------------------------------------------

    def enter(self) -> None:
        """A request that needs the engine begins (in a worker thread: it may load the
        model again). The server does not sleep until it ``leave``s."""
        with self._sleep_lock:
            self._in_flight += 1
            if not self.sleeping:
                return
            log.info("server is exiting sleeping state")
            try:
                scales = self._asleep_scales
                self._start_engine(self.model_path)
                self.engine.adapters.scales = scales  # POST /lora-adapters' outlive a sleep
            except BaseException as e:  # noqa: BLE001 - llama-server aborts; this one stops
                self._in_flight -= 1
                self.failed = f"{type(e).__name__}: {e}"
                self.exit_code = 1
                log.error("failed to load the model again after sleeping: %s", e)
                if self.on_fatal is not None:
                    self.on_fatal()
                raise APIError("the model could not be loaded again", "server_error") from None
            self.sleeping = False
            self.asleep_bodies = {}

    def leave(self) -> None:
        with self._sleep_lock:
            self._in_flight -= 1
            self.last_active = time.monotonic()

    def idle_for(self) -> float:
        """Seconds since the last request that needed the engine ended; 0 while one is in
        flight, queued or generating, or while asleep."""
        w = self.worker
        if self.sleeping or self._in_flight or (w is not None and (w.n_running or w.n_waiting)):
            return 0.0
        return time.monotonic() - self.last_active

    def sleep(self, idle_s: float) -> bool:
        """Free the engine if the server has been idle ``idle_s`` seconds (checked again
        under the lock: a request may have come meanwhile); True when it did."""
        with self._sleep_lock:
            if self._closed or not self.ready.is_set() or self.engine is None or self.idle_for() < idle_s:
                return False
            log.info("server is entering sleeping state (idle for %.0f s)", self.idle_for())
            self.sleeping = True
            self._asleep_scales = list(self.engine.adapters.scales)
            if self.worker is not None:
                self.worker.stop()
            self.engine.close()
            self.engine = self.api = self.worker = None
            return True

    def _on_done(self, job: Job, result: Completion | None, error: BaseException | None, n_seen: int) -> None:
        self.metrics.record(result, cancelled=isinstance(error, Cancelled), failed=error is not None
                            and not isinstance(error, Cancelled))

    def begin_shutdown(self) -> None:
        """The server stops: end the running and waiting generations now, so that their
        streams finish (with an error event) instead of being cut after the grace period."""
        if self.worker is not None:
            self.worker.cancel_all()

    def close(self) -> None:
        if self._closed:
            return
        with self._sleep_lock:  # not while a request loads the model again
            self._closed = True
            self.templates.close()
            stopped = True
            if self.worker is not None:
                stopped = self.worker.stop()
            if self.engine is not None and stopped:
                self.engine.close()

    # -- helpers for the routes ---------------------------------------------------

    def need_engine(self) -> Engine:
        if not self.ready.is_set() or self.engine is None:
            raise APIError("Loading model", "unavailable_error")
        return self.engine

    def need_api(self) -> API:
        self.need_engine()
        assert self.api is not None
        return self.api

    def mtp_mode(self) -> str:
        return self.cfg.mtp_mode if self.cfg.speculative else "none"


def _si(n: int) -> str:
    for unit, k in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= k:
            return f"{n / k:.2f}{unit}"
    return str(n)


def _host_for_url(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
