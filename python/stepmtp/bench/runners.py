"""Where the requests go: an in-process ``Engine``, a server at a URL, or a server
process the bench starts itself (ours, ``python -m stepmtp.server``, or the vendored
C++ ``llama-server``).

Every runner answers ``run(prompt, n_predict)`` with a ``Result``: the text, what was
predicted, drafted and accepted (per draft depth where known) and how long it took.
"""
from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

__all__ = ["BenchConfig", "Result", "Runner", "EngineRunner", "URLRunner", "ServerProcess", "ServerRunner",
           "parse_configs", "find_llama_server", "COMPARE_CONFIGS"]

BACKENDS = ("engine", "server", "llama-server", "url")


@dataclass(frozen=True)
class BenchConfig:
    """One configuration of the comparison.

    ``backend``: ``engine`` (in-process), ``server`` (``python -m stepmtp.server``
    started by the bench), ``llama-server`` (the vendored C++ server, single-block MTP:
    head 0 looped), ``url`` (a server already running; its own settings apply).
    """

    mode: str = "chain"  # chain | single | none
    n_max: int = 3
    schedule: str = "fused"  # fused | reference (in-process and stepmtp.server)
    backend: str = "engine"
    #: requests sample at this temperature (with a fixed seed per prompt) when > 0
    temperature: float = 0.0
    #: verification above temperature 0: exact | rejection (stepmtp only)
    verify: str = "exact"
    #: adaptive draft length, n_max the upper bound (stepmtp only)
    adaptive: bool = False
    #: server slots (-np): 0 the bench's choice (1, or --parallel's N), -1 the server's
    #: default (auto: 4 slots, a unified KV cache), N that many
    slots: int = 0
    #: draft from the context too (stepmtp only; off: the MTP3 change's benchmark measures
    #: the heads, and its counts are the CI gate's)
    context: bool = False

    def __post_init__(self) -> None:
        if self.slots and self.backend not in ("server", "llama-server"):
            raise ValueError("-np applies to servers the bench starts (srv-..., cpp-...)")
        if self.slots < -1:
            raise ValueError(f"bad slot count {self.slots}")
        if self.verify not in ("exact", "rejection"):
            raise ValueError(f"unknown verification {self.verify!r} (exact, rejection)")
        if not 0.0 <= self.temperature <= 5.0:
            raise ValueError(f"temperature {self.temperature} out of [0, 5]")
        if self.backend == "llama-server" and (self.verify != "exact" or self.adaptive):
            raise ValueError("the C++ llama-server verifies by exact match with a fixed draft length")
        if self.mode not in ("chain", "single", "none"):
            raise ValueError(f"unknown mode {self.mode!r} (chain, single, none)")
        if self.schedule not in ("fused", "reference"):
            raise ValueError(f"unknown schedule {self.schedule!r} (fused, reference)")
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r} ({', '.join(BACKENDS)})")
        if self.backend == "llama-server" and self.mode == "chain":
            raise ValueError("the C++ llama-server drafts with one MTP block (mode single), it cannot chain")
        if self.backend == "llama-server" and self.schedule != "fused":
            raise ValueError("the C++ llama-server has one schedule (the single-block one)")
        if self.context and (self.backend == "llama-server" or self.mode == "none"):
            raise ValueError("context drafting (ctx) is stepmtp's, beside the heads")
        if self.mode != "none" and self.n_max < 1:
            raise ValueError("speculation needs n_max >= 1")

    @property
    def label(self) -> str:
        if self.backend == "url":
            return "url"
        prefix = {"engine": "", "server": "srv-", "llama-server": "cpp-"}[self.backend]
        temp = f"-t{self.temperature:g}" if self.temperature > 0 else ""
        ref = "-ref" if self.schedule == "reference" else ""
        rej = "-rej" if self.verify == "rejection" else ("-exact" if self.temperature > 0 else "")
        adapt = ("-adapt" if self.adaptive else "") + ("-ctx" if self.context else "")
        np_ = "" if not self.slots else ("-npauto" if self.slots < 0 else f"-np{self.slots}")
        if self.mode == "none":
            return prefix + "none" + temp + np_
        return f"{prefix}{self.mode}-{self.n_max}{ref}{adapt}{temp}{rej}{np_}"

    @property
    def family(self) -> str:
        """Configurations compared against the same no-speculation run (same backend,
        same temperature)."""
        fam = {"engine": "engine", "server": "server", "llama-server": "llama-server", "url": "url"}[self.backend]
        return fam + (f"@t{self.temperature:g}" if self.temperature > 0 else "")

    def describe(self) -> str:
        if self.backend == "url":
            return "the server at the URL, as it is configured"
        where = {"engine": "in-process", "server": "stepmtp.server", "llama-server": "C++ llama-server"}[self.backend]
        if self.slots:
            where += ", -np " + ("auto" if self.slots < 0 else str(self.slots))
        if self.mode == "none":
            return f"no speculation ({where})"
        temp = f", temperature {self.temperature:g}" if self.temperature > 0 else ""
        if self.mode == "none":
            return f"no speculation{temp} ({where})"
        if self.backend == "llama-server":
            return f"single-block MTP (head 0 for every step), n-max {self.n_max}{temp} ({where})"
        extra = (", adaptive length" if self.adaptive else "") + temp
        if self.temperature > 0:
            extra += f", {self.verify} verification"
        return f"{self.mode}, n-max {self.n_max}, {self.schedule} schedule{extra} ({where})"

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "mode": self.mode, "n_max": self.n_max if self.mode != "none" else 0,
                "schedule": self.schedule, "backend": self.backend, "temperature": self.temperature,
                "verify": self.verify, "adaptive": self.adaptive, "slots": self.slots,
                "context": self.context}

    def request_settings(self) -> dict[str, Any]:
        """Sampling of a request: greedy, or this temperature with a fixed seed."""
        if self.temperature > 0:
            return {"temperature": self.temperature, "seed": SAMPLING_SEED}
        return {"temperature": 0.0}

    @classmethod
    def parse(cls, spec: str) -> "BenchConfig":
        """``none``, ``chain-3``, ``single:2``, ``chain-3-ref``, ``cpp-single-2``,
        ``cpp-none``, ``srv-chain-3``, ``chain-3-adapt``, ``chain-3-t0.7-rej``,
        ``none-t0.7``, ``srv-none-npauto``, ``chain-3-adapt-ctx`` (``:`` or ``-`` separated;
        ``tX`` samples at temperature X, ``rej``/``exact`` picks the verification, ``adapt``
        the adaptive length, ``ctx`` context drafting beside the heads, ``npN``/``npauto``
        a server's slots)."""
        parts = [p for p in spec.strip().replace(":", "-").split("-") if p]
        backend = "engine"
        if parts and parts[0] in ("cpp", "llama", "srv", "server"):
            backend = "llama-server" if parts.pop(0) in ("cpp", "llama") else "server"
        if not parts:
            raise ValueError(f"bad configuration {spec!r}")
        mode = parts.pop(0)
        if mode not in ("none", "chain", "single"):
            raise ValueError(f"bad configuration {spec!r}: mode {mode!r} is not none, chain or single")
        n_max = 0 if mode == "none" else 3
        if mode != "none" and parts and parts[0].isdigit():
            n_max = int(parts.pop(0))
        kw: dict[str, Any] = {}
        for p in parts:
            if p in ("ref", "reference", "fused") and mode != "none":
                kw["schedule"] = "fused" if p == "fused" else "reference"
            elif p in ("adapt", "adaptive") and mode != "none":
                kw["adaptive"] = True
            elif p == "ctx" and mode != "none":
                kw["context"] = True
            elif p in ("rej", "rejection", "exact") and mode != "none":
                kw["verify"] = "exact" if p == "exact" else "rejection"
            elif p.startswith("t") and _is_float(p[1:]):
                kw["temperature"] = float(p[1:])
            elif p == "npauto":
                kw["slots"] = -1
            elif p.startswith("np") and p[2:].isdigit() and int(p[2:]) > 0:
                kw["slots"] = int(p[2:])
            else:
                raise ValueError(f"bad configuration {spec!r}: {p!r}")
        return cls(mode=mode, n_max=n_max, backend=backend, **kw)


def _is_float(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


def parse_configs(text: str | Sequence[str]) -> list[BenchConfig]:
    items = text.split(",") if isinstance(text, str) else list(text)
    out: list[BenchConfig] = []
    for s in items:
        if s.strip():
            c = BenchConfig.parse(s)
            if c.label in {o.label for o in out}:
                raise ValueError(f"configuration {c.label} given twice")
            out.append(c)
    if not out:
        raise ValueError("no configuration")
    return out


#: the seed of every sampled request (temperature > 0): runs are repeatable
SAMPLING_SEED = 1234

#: ``--compare``: no speculation; single and chain at n-max 2 and 3; the change's
#: (reference) schedule next to the fused one for chain.
COMPARE_CONFIGS = ("none", "single-2", "single-3", "chain-2", "chain-3", "chain-2-ref", "chain-3-ref")
#: added to ``--compare`` when a C++ llama-server binary is at hand
COMPARE_CPP_CONFIGS = ("cpp-none", "cpp-single-2", "cpp-single-3")
#: ``--compare verify``: exact match against rejection sampling at three temperatures
COMPARE_VERIFY_CONFIGS = tuple(c for t in ("0.3", "0.7", "1") for c in
                               (f"none-t{t}", f"chain-3-t{t}-exact", f"chain-3-t{t}-rej"))
#: ``--compare adaptive``: the adaptive length against every fixed n-max
COMPARE_ADAPTIVE_CONFIGS = ("none", "chain-1", "chain-2", "chain-3", "chain-3-adapt")
#: ``--compare slots``: the server with its default slots (-np auto: 4, a unified KV
#: cache) against one slot, for one client: what users get by default
COMPARE_SLOTS_CONFIGS = ("srv-none", "srv-none-npauto", "srv-chain-3", "srv-chain-3-npauto")
COMPARE_SETS = {"schedules": COMPARE_CONFIGS, "verify": COMPARE_VERIFY_CONFIGS,
                "adaptive": COMPARE_ADAPTIVE_CONFIGS, "slots": COMPARE_SLOTS_CONFIGS}


@dataclass
class Result:
    """One request."""

    category: str
    label: str
    text: str
    n_prompt: int
    predicted: int
    drafted: int
    accepted: int
    #: per draft depth (None when the backend does not say)
    drafted_per_depth: list[int] | None
    accepted_per_depth: list[int] | None
    #: generation time (after the prompt), as the backend measured it
    gen_ms: float
    prompt_ms: float
    #: the request as the bench saw it, prompt and transport included
    wall_s: float
    #: in-process only
    rounds: int | None = None
    target_decodes: int | None = None
    draft_decodes: int | None = None
    target_rows: int | None = None
    draft_rows: int | None = None
    t_python_ms: float | None = None
    #: the generated tokens (in-process; None where a backend does not return them)
    tokens: list[int] | None = None
    #: decodes the prompt took (in-process)
    prompt_target_decodes: int | None = None
    prompt_draft_decodes: int | None = None
    #: the prompt's tokens its slot's cache held (in-process)
    prompt_cached: int | None = None
    #: with --repeat: every repeat's generation time (gen_ms is the best of them)
    gen_ms_repeats: list[float] = field(default_factory=list)

    @property
    def prompt_target_rows(self) -> int | None:
        """The prompt's rows the target decoded (what its slot's cache did not hold:
        llama-server's timings.prompt_n)."""
        return None if self.prompt_cached is None else self.n_prompt - self.prompt_cached

    @property
    def rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tok_s(self) -> float:
        return 1e3 * self.predicted / self.gen_ms if self.gen_ms > 0 else 0.0

    @property
    def spread(self) -> float:
        """How much the repeats' speeds differed: slowest / fastest time - 1 (0 with
        one run). The noise a comparison of this prompt's speeds has to allow for."""
        ts = self.gen_ms_repeats
        return max(ts) / min(ts) - 1.0 if len(ts) > 1 and min(ts) > 0 else 0.0

    def counts(self) -> dict[str, Any]:
        """What is deterministic at temperature 0."""
        return {"pred": self.predicted, "draft": self.drafted, "acc": self.accepted,
                "draft_per_depth": self.drafted_per_depth, "acc_per_depth": self.accepted_per_depth}

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items()}
        d["rate"] = self.rate
        d["tok_s"] = self.tok_s
        return d


class Runner:
    """Runs requests for one configuration."""

    config: BenchConfig

    def start(self) -> None:  # noqa: B027 - optional
        pass

    def run(self, category: str, prompt: str, n_predict: int) -> Result:
        raise NotImplementedError

    def close(self) -> None:  # noqa: B027 - optional
        pass

    def info(self) -> dict[str, Any]:
        return {}

    def __enter__(self) -> "Runner":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- in-process ------------------------------------------------------------------


# -- memory: llama.cpp's KV bytes and the process's peak RSS ------------------------------


def peak_rss(pid: int | str = "self") -> int | None:
    """A process's peak resident set (VmHWM), bytes; None where /proc has none."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def llama_server_kv(model: str | Path, n_ctx: int, n_parallel: int, mtp: bool, n_ubatch: int = 512,
                    mtp_model: str | Path | None = None, kv_types: dict[str, tuple[str, str]] | None = None) -> int:
    """The KV bytes llama-server allocates for these flags (its defaults otherwise; -np
    -1: auto, 4 slots sharing a unified cache; ``kv_types``: -ctk/-ctv as ``target``,
    -ctkd/-ctvd as ``draft``): its target context and, with draft-mtp, its one MTP
    context of all the blocks, made here through the same llama.cpp and measured (its
    log prints them only with -v)."""
    from ..llama import Context, Model

    types = {"target": ("f16", "f16"), "draft": ("f16", "f16"), **(kv_types or {})}
    unified, n_seq = (True, 4) if n_parallel < 0 else (False, n_parallel)
    kw = dict(n_ctx=n_ctx, n_seq_max=n_seq, kv_unified=unified, n_ubatch=n_ubatch, n_threads=1)
    tk, tv = types["target"]
    dk, dv = types["draft"]
    with Model(model) as m:
        with Context(m, type_k=tk, type_v=tv, **kw) as t:
            kv = t.memory()["kv"]
        if mtp and mtp_model is None:
            with Context(m, mtp=True, type_k=dk, type_v=dv, **kw) as d:
                kv += d.memory()["kv"]
    if mtp and mtp_model is not None:
        with Model(mtp_model) as dm, Context(dm, mtp=True, type_k=dk, type_v=dv, **kw) as d:
            kv += d.memory()["kv"]
    return kv


def kv_summary(mem: dict[str, dict[str, int]]) -> dict[str, int]:
    """A configuration's memory line from ``Engine.memory()`` (or /props'
    ``stepmtp.memory``): KV of target and draft, each and together, and compute."""
    return {"kv": mem["target"]["kv"] + mem["draft"]["kv"], "target_kv": mem["target"]["kv"],
            "draft_kv": mem["draft"]["kv"], "compute": mem["target"]["compute"] + mem["draft"]["compute"]}


def kv_types_of(argv: Sequence[str]) -> dict[str, tuple[str, str]]:
    """-ctk / -ctv / -ctkd / -ctvd of a server's flags, as ``llama_server_kv`` takes them."""
    def get(*names: str) -> str:
        found = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in names]
        return found[-1] if found else "f16"

    return {"target": (get("-ctk", "--cache-type-k"), get("-ctv", "--cache-type-v")),
            "draft": (get("-ctkd", "--cache-type-k-draft"), get("-ctvd", "--cache-type-v-draft"))}


class EngineRunner(Runner):
    """An ``Engine`` in this process."""

    def __init__(self, config: BenchConfig, model: str | Path, *, mtp_model: str | Path | None = None,
                 n_ctx: int = 2048, n_threads: int | None = None, engine_kw: dict[str, Any] | None = None) -> None:
        self.config = config
        self.model, self.mtp_model = model, mtp_model
        self.kw = dict(n_ctx=n_ctx, n_threads=n_threads, **(engine_kw or {}))
        self.engine = None

    def start(self) -> None:
        from ..engine import Engine

        c = self.config
        self.engine = Engine(self.model, mtp_model=self.mtp_model, mode=c.mode, n_max=max(1, c.n_max),
                             schedule=c.schedule, verify=c.verify, adaptive=c.adaptive, context=c.context, **self.kw)

    def run(self, category: str, prompt: str, n_predict: int) -> Result:
        t0 = time.perf_counter()
        out = self.engine.generate(prompt, n_predict=n_predict, **self.config.request_settings())
        wall = time.perf_counter() - t0
        st = out.stats
        return Result(
            category=category, label=self.config.label, text=out.text, n_prompt=st.n_prompt,
            predicted=st.n_predicted, drafted=st.n_drafted, accepted=st.n_accepted,
            drafted_per_depth=list(st.drafted_per_depth), accepted_per_depth=list(st.accepted_per_depth),
            gen_ms=st.t_gen_ms, prompt_ms=st.t_prompt_ms, wall_s=wall, rounds=st.n_rounds,
            target_decodes=st.n_target_decodes, draft_decodes=st.n_draft_decodes,
            target_rows=st.n_target_rows, draft_rows=st.n_draft_rows, t_python_ms=st.t_python_ms,
            prompt_target_decodes=st.n_prompt_target_decodes, prompt_draft_decodes=st.n_prompt_draft_decodes,
            prompt_cached=st.n_prompt_cached,
            tokens=list(out.tokens))

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def info(self) -> dict[str, Any]:
        e = self.engine
        if e is None:
            return {}
        return {"n_heads": e.n_heads, "n_draft": e.driver.n_draft, "n_ctx": e.n_ctx,
                "n_threads": self.kw.get("n_threads"), "memory": kv_summary(e.memory())}
        # no peak RSS per configuration in-process: the configurations' engines live
        # side by side in one process (the server runs give one per process)


# -- HTTP ----------------------------------------------------------------------------


def run_clients(n_clients: int, jobs: Sequence[Callable[[], Any]], what: str = "") -> tuple[list[Any], float]:
    """``jobs`` run by ``n_clients`` threads, each taking the next job as it finishes one
    (as that many clients of a server send their requests): the results in the jobs'
    order and the wall time; a RuntimeError naming the first failure once all stopped."""
    results: list[Any] = [None] * len(jobs)
    errors: list[BaseException] = []
    todo = iter(range(len(jobs)))
    lock = threading.Lock()

    def client() -> None:
        while not errors:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            try:
                results[i] = jobs[i]()
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors.append(e)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(n_clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{what + ': ' if what else ''}a request failed: {errors[0]}")
    return results, wall


def completion(url: str, body: dict[str, Any], timeout: float, api_key: str | None = None) -> dict[str, Any]:
    """POST ``body`` to ``url``/completion: the response's JSON, or a RuntimeError with the
    HTTP status and the start of the server's answer."""
    status, resp = _http(url + "/completion", body, timeout, api_key)
    if status != 200:
        raise RuntimeError(f"{url}/completion: HTTP {status}: {str(resp)[:500]!r}")
    return resp


def _http(url: str, body: dict[str, Any] | None = None, timeout: float = 600.0,
          api_key: str | None = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} if data else {}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    try:
        return status, json.loads(raw) if raw else None
    except json.JSONDecodeError:
        return status, raw.decode("utf-8", "replace")


def _per_depth(resp: dict[str, Any], timings: dict[str, Any], key: str) -> list[int] | None:
    for src in (timings, resp.get("mtp") or {}):
        v = src.get(key)
        if isinstance(v, list):
            return [int(x) for x in v]
    return None


class URLRunner(Runner):
    """POST /completion to a llama-server-compatible server (ours or llama.cpp's)."""

    def __init__(self, url: str, config: BenchConfig | None = None, *, timeout: float = 600.0,
                 api_key: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.config = config or BenchConfig(mode="none", n_max=0, backend="url")
        self.timeout = timeout
        self.api_key = api_key
        self.props: dict[str, Any] = {}

    def start(self) -> None:
        try:
            status, props = _http(self.url + "/props", timeout=30)
            if status == 200 and isinstance(props, dict):
                self.props = props
        except OSError:
            pass

    def run(self, category: str, prompt: str, n_predict: int) -> Result:
        body = {"prompt": prompt, "n_predict": n_predict, **self.config.request_settings(), "cache_prompt": False,
                "stream": False}
        t0 = time.perf_counter()
        resp = completion(self.url, body, self.timeout, self.api_key)
        wall = time.perf_counter() - t0
        t = resp.get("timings") or {}
        mtp = resp.get("mtp") or {}
        predicted = int(t.get("predicted_n", resp.get("tokens_predicted", 0)))
        gen_ms = float(t.get("predicted_ms") or 0.0)
        if not gen_ms and t.get("predicted_per_second"):
            gen_ms = 1e3 * predicted / float(t["predicted_per_second"])
        return Result(
            category=category, label=self.config.label, text=resp.get("content", ""),
            n_prompt=int(t.get("prompt_n", resp.get("tokens_evaluated", 0))), predicted=predicted,
            drafted=int(t.get("draft_n", 0)), accepted=int(t.get("draft_n_accepted", 0)),
            drafted_per_depth=_per_depth(resp, t, "draft_n_per_depth"),
            accepted_per_depth=_per_depth(resp, t, "draft_n_accepted_per_depth"),
            gen_ms=gen_ms, prompt_ms=float(t.get("prompt_ms") or 0.0), wall_s=wall,
            rounds=int(mtp["rounds"]) if "rounds" in mtp else None)

    def info(self) -> dict[str, Any]:
        gs = self.props.get("default_generation_settings", {}) if self.props else {}
        params = gs.get("params", gs) if isinstance(gs, dict) else {}
        keep = {k: v for k, v in params.items() if k.startswith("speculative")}
        out = {"url": self.url, "model": self.props.get("model_path"), **keep}
        mem = (self.props.get("stepmtp") or {}).get("memory")
        if mem:
            out["memory"] = kv_summary(mem)
        return out


# -- server processes --------------------------------------------------------------------

_LIVE: set["ServerProcess"] = set()


def _close_all() -> None:
    for s in list(_LIVE):
        s.close()


atexit.register(_close_all)


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    """Linux: the server gets SIGTERM if the bench dies without cleaning up (SIGKILL)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


class ServerProcess:
    """A server process on a free port of 127.0.0.1, ready once /health says 200;
    terminated (its whole process group) by ``close()``, at exit, and on Ctrl-C
    (the ``with`` block unwinds)."""

    def __init__(self, argv: Sequence[str], *, host: str = "127.0.0.1", startup_timeout: float = 600.0,
                 env: dict[str, str] | None = None, label: str = "server") -> None:
        self.argv = list(argv)
        self.host = host
        self.port = 0
        self.startup_timeout = startup_timeout
        self.env = env
        self.label = label
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = tempfile.NamedTemporaryFile(prefix=f"stepmtp-bench-{label}-", suffix=".log", delete=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        self.port = _free_port(self.host)
        argv = self.argv + ["--host", self.host, "--port", str(self.port)]
        self.proc = subprocess.Popen(
            argv, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=self._env(), start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
        _LIVE.add(self)
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if self.proc.poll() is not None:
                tail = self.log_tail()
                self.close()
                raise RuntimeError(f"{self.label} exited with status {self.proc.returncode} before it was ready:\n"
                                   f"  {' '.join(argv)}\n{tail}")
            try:
                status, _ = _http(self.url + "/health", timeout=2)
                if status == 200:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                tail = self.log_tail()
                self.close()
                raise RuntimeError(f"{self.label} not ready after {self.startup_timeout:.0f} s:\n{tail}")
            time.sleep(0.2)

    def _env(self) -> dict[str, str]:
        # llama-server reads its flags from LLAMA_ARG_* too: keep the caller's out of the comparison
        env = {k: v for k, v in os.environ.items() if not k.startswith(("LLAMA_ARG_", "LLAMA_API_KEY"))}
        env.update(self.env or {})
        return env

    def log_tail(self, n: int = 20) -> str:
        try:
            lines = Path(self.log.name).read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join("  | " + ln for ln in lines[-n:])

    def close(self) -> None:
        p = self.proc
        if p is not None and p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(timeout=15)
        _LIVE.discard(self)
        try:
            self.log.close()
            if p is None or p.returncode in (0, -signal.SIGTERM, -signal.SIGKILL):
                os.unlink(self.log.name)
        except OSError:
            pass


def find_llama_server() -> Path | None:
    """The vendored C++ llama-server installed with the package (built with
    ``CMAKE_ARGS="-DSTEPMTP_BUILD_SERVER=on"``), if any."""
    p = Path(__file__).resolve().parent.parent / "bin" / "llama-server"
    if p.is_file() and os.access(p, os.X_OK):
        return p
    w = shutil.which("llama-server")
    return Path(w) if w else None


class ServerRunner(URLRunner):
    """A server process started for one configuration: ``python -m stepmtp.server``
    (backend ``server``) or a C++ ``llama-server`` binary (backend ``llama-server``),
    with llama-server's flags."""

    def __init__(self, config: BenchConfig, model: str | Path, *, mtp_model: str | Path | None = None,
                 n_ctx: int = 2048, n_threads: int | None = None, llama_server: str | Path | None = None,
                 startup_timeout: float = 600.0, timeout: float = 600.0, n_parallel: int = 1,
                 batch_invariant: bool = False, placement_args: Sequence[str] = ()) -> None:
        super().__init__("http://127.0.0.1:0", config, timeout=timeout)
        self._kv_args = dict(model=model, n_ctx=n_ctx, n_parallel=-1 if config.slots < 0 else
                             (config.slots or n_parallel), mtp=config.mode != "none", mtp_model=mtp_model,
                             kv_types=kv_types_of(placement_args))
        if config.backend == "llama-server":
            exe = llama_server or find_llama_server()
            if exe is None:
                raise FileNotFoundError("no llama-server binary: pass --llama-server PATH (build it with "
                                        "CMAKE_ARGS=\"-DSTEPMTP_BUILD_SERVER=on\" pip install .)")
            # both with their default sliding-window cache (the window plus one ubatch)
            argv = [str(exe)]
        else:
            argv = [sys.executable, "-m", "stepmtp.server"]
        argv += ["-m", str(model), "-c", str(n_ctx), "--temp", "0"]
        if config.slots >= 0:
            argv += ["-np", str(config.slots or n_parallel)]
        if n_threads:
            argv += ["-t", str(n_threads)]
        if config.mode != "none":
            argv += ["--spec-type", "draft-mtp", "--spec-draft-n-max", str(config.n_max),
                     "--spec-draft-n-min", "0", "--spec-draft-p-min", "0.0"]
            if mtp_model is not None:
                argv += ["--spec-draft-model", str(mtp_model)]
            if config.backend == "server":
                argv += ["--spec-mtp-mode", config.mode, "--spec-verify", config.verify]
                if config.schedule != "fused":
                    argv += ["--spec-schedule", config.schedule]
                argv += ["--spec-adaptive" if config.adaptive else "--no-spec-adaptive"]
                if not config.context:
                    argv += ["--no-spec-context"]
        if batch_invariant and config.backend == "server":
            argv += ["--spec-batch-invariant"]
        argv += list(placement_args)  # llama-server's flags: the same for both servers
        self.process = ServerProcess(argv, startup_timeout=startup_timeout, label=config.label)

    def start(self) -> None:
        self.process.start()
        self.url = self.process.url
        super().start()

    def close(self) -> None:
        self.process.close()

    def info(self) -> dict[str, Any]:
        out = {"argv": self.process.argv, **super().info()}
        mem = dict(out.get("memory") or {})
        if "kv" not in mem:  # llama-server: its contexts' KV, as llama.cpp allocates them
            mem["kv"] = llama_server_kv(**self._kv_args)
        if self.process.proc is not None:
            mem["peak_rss"] = peak_rss(self.process.proc.pid)
        out["memory"] = mem
        return out
