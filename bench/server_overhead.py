"""What the HTTP layer of ``python -m stepmtp.server`` costs, per request and per token.

Runs the same greedy generations on the tiny agree model (the server's default
model) through the Engine directly and through a server subprocess
(``/completion``, whole and streamed), interleaved so that a busy machine slows
both alike, and prints minima and medians:

    python bench/server_overhead.py [--reps 15] [--n 256] [--threads 1]

per request = server(n_predict=1) - direct(n_predict=1); per token = the rest of
the difference at n_predict=N, divided by N. Nothing is asserted: on the tiny
model a token costs ~1 ms, so this is an upper bound of the share the HTTP layer
takes from a real model's much slower tokens.
"""
from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from stepmtp import Engine
from stepmtp.server.config import default_model_path

PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--n", type=int, default=256, help="tokens per long request")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=4096)
    args = ap.parse_args()

    model = default_model_path()
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="stepmtp-server-", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "stepmtp.server", "-m", str(model), "--spec-type", "draft-mtp",
                             "-c", str(args.ctx), "-t", str(args.threads), "--host", "127.0.0.1", "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                print(Path(log.name).read_text()[-3000:], file=sys.stderr)
                return 1
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)

        times: dict[str, list[float]] = {k: [] for k in ("direct1", "server1", "directN", "serverN", "streamN")}
        # CPU seconds spent by each side (all its threads), per request, over a batch of
        # requests (the server's is counted in 10 ms ticks): less changed than wall time
        # by other work on the machine
        cpu: dict[str, float] = {}
        server_proc = psutil.Process(proc.pid)

        def server_cpu() -> float:
            t = server_proc.cpu_times()
            return t.user + t.system
        engine_tps: list[float] = []
        with Engine(model, mode="chain", n_ctx=args.ctx, n_threads=args.threads) as eng, \
                httpx.Client(base_url=url, timeout=120) as http:
            def direct(n: int) -> float:
                t0 = time.perf_counter()
                out = eng.generate(PROMPT, n_predict=n, temperature=0)
                dt = time.perf_counter() - t0
                if n > 1:
                    engine_tps.append(out.stats.tokens_per_second)
                return dt

            def server(n: int) -> float:
                t0 = time.perf_counter()
                r = http.post("/completion", json={"prompt": PROMPT, "n_predict": n, "temperature": 0})
                dt = time.perf_counter() - t0
                assert r.status_code == 200 and r.json()["tokens_predicted"] == n, r.text
                return dt

            def stream(n: int) -> float:
                t0 = time.perf_counter()
                with http.stream("POST", "/completion", json={"prompt": PROMPT, "n_predict": n, "temperature": 0,
                                                              "stream": True}) as r:
                    last = None
                    for line in r.iter_lines():
                        if line:
                            last = line
                dt = time.perf_counter() - t0
                assert last is not None and json.loads(last[6:])["tokens_predicted"] == n
                return dt

            for _ in range(3):  # warm up both
                direct(args.n), server(args.n), stream(args.n)
            for _ in range(args.reps):
                times["direct1"].append(direct(1))
                times["server1"].append(server(1))
                times["directN"].append(direct(args.n))
                times["serverN"].append(server(args.n))
                times["streamN"].append(stream(args.n))
            for key, fn, n_tok, own in (("direct1", direct, 1, True), ("server1", server, 1, False),
                                        ("directN", direct, args.n, True), ("serverN", server, args.n, False),
                                        ("streamN", stream, args.n, False)):
                reps = args.reps * (8 if n_tok == 1 else 1)
                c0 = time.process_time() if own else server_cpu()
                for _ in range(reps):
                    fn(n_tok)
                cpu[key] = ((time.process_time() if own else server_cpu()) - c0) / reps
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()

    n = args.n
    print(f"tiny agree model, chain mode, {n} tokens per request, {args.reps} reps, {args.threads} thread(s)")
    for label, stat in (("wall time, min", min), ("wall time, median", statistics.median)):
        report(label, {k: stat(v) for k, v in times.items()}, n, max(engine_tps) if stat is min else stat(engine_tps))
    c = cpu
    per_request = c["server1"] - c["direct1"]
    print("CPU time per request (all threads of each process), mean over a batch:")
    print(f"  direct n=1: {1e3 * c['direct1']:.2f} ms, n={n}: {1e3 * c['directN']:.2f} ms; "
          f"server n=1: {1e3 * c['server1']:.2f} ms, n={n}: {1e3 * c['serverN']:.2f} ms, "
          f"SSE n={n}: {1e3 * c['streamN']:.2f} ms")
    print(f"  HTTP overhead: {1e3 * per_request:.2f} ms per request; per token "
          f"{1e6 * (c['serverN'] - c['directN'] - per_request) / n:.1f} us (whole), "
          f"{1e6 * (c['streamN'] - c['directN'] - per_request) / n:.1f} us (streamed)")
    return 0


def report(label: str, med: dict[str, float], n: int, engine_tps: float) -> None:
    per_request = med["server1"] - med["direct1"]
    per_token = (med["serverN"] - med["directN"] - per_request) / n
    per_token_stream = (med["streamN"] - med["directN"] - per_request) / n
    print(f"{label}:")
    print(f"  direct Engine.generate  n=1: {1e3 * med['direct1']:7.2f} ms   n={n}: {1e3 * med['directN']:8.2f} ms"
          f"   {n / med['directN']:7.1f} tok/s (engine's own t_gen: {engine_tps:.1f} tok/s)")
    print(f"  server /completion      n=1: {1e3 * med['server1']:7.2f} ms   n={n}: {1e3 * med['serverN']:8.2f} ms"
          f"   {n / med['serverN']:7.1f} tok/s")
    print(f"  server /completion SSE                        n={n}: {1e3 * med['streamN']:8.2f} ms"
          f"   {n / med['streamN']:7.1f} tok/s")
    print(f"  HTTP overhead: {1e3 * per_request:.2f} ms per request; per token {1e6 * per_token:.1f} us (whole), "
          f"{1e6 * per_token_stream:.1f} us (streamed, one SSE event per token)")


if __name__ == "__main__":
    sys.exit(main())
