"""What the HTTP layer of ``python -m stepmtp.server`` costs, per request and per token.

Runs the same greedy generations on the tiny agree model (the server's default
model) through the Engine directly and through a server subprocess
(``POST /completion``, whole and streamed as SSE), back to back, and prints:

* tok/s of each (medians);
* the overhead, from the paired differences (server - direct, each pair run back to
  back, so that a busy machine slows both alike): per request = median difference at
  n_predict=1, per token = (median difference at n_predict=N - per request) / N;
* the server's own split: a request's latency seen by the client minus the time the
  engine reports in its ``timings`` (prompt_ms + predicted_ms).

    python bench/server_overhead.py [--reps 30] [--n 256] [--threads 1]

Nothing is asserted. On the tiny model a token costs ~1-2 ms, so the shares printed
are upper bounds of what the HTTP layer takes from a real model's much slower tokens.
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

from stepmtp import Engine
from stepmtp.server.config import default_model_path

PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4)
    return q[0], statistics.median(xs), q[2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--n", type=int, default=256, help="tokens per long request")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=4096)
    args = ap.parse_args()
    n = args.n

    model = default_model_path()
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="stepmtp-server-", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "stepmtp.server", "-m", str(model), "--spec-type", "draft-mtp",
                             "-c", str(args.ctx), "-t", str(args.threads), "--host", "127.0.0.1", "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    rows: dict[str, list[float]] = {k: [] for k in ("direct1", "server1", "directN", "serverN", "streamN",
                                                   "engine_direct1", "engine_directN", "engine_server1",
                                                   "engine_serverN", "engine_streamN")}
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

        with Engine(model, mode="chain", n_ctx=args.ctx, n_threads=args.threads) as eng, \
                httpx.Client(base_url=url, timeout=120) as http:
            def direct(k: int) -> tuple[float, float]:
                t0 = time.perf_counter()
                out = eng.generate(PROMPT, n_predict=k, temperature=0)
                return time.perf_counter() - t0, (out.stats.t_prompt_ms + out.stats.t_gen_ms) / 1e3

            def server(k: int) -> tuple[float, float]:
                t0 = time.perf_counter()
                r = http.post("/completion", json={"prompt": PROMPT, "n_predict": k, "temperature": 0})
                dt = time.perf_counter() - t0
                body = r.json()
                assert r.status_code == 200 and body["tokens_predicted"] == k, r.text
                return dt, (body["timings"]["prompt_ms"] + body["timings"]["predicted_ms"]) / 1e3

            def stream(k: int) -> tuple[float, float]:
                t0 = time.perf_counter()
                with http.stream("POST", "/completion", json={"prompt": PROMPT, "n_predict": k, "temperature": 0,
                                                              "stream": True}) as r:
                    last = None
                    for line in r.iter_lines():
                        if line:
                            last = line
                dt = time.perf_counter() - t0
                body = json.loads(last[len("data: "):])
                assert body["tokens_predicted"] == k
                return dt, (body["timings"]["prompt_ms"] + body["timings"]["predicted_ms"]) / 1e3

            for _ in range(3):  # warm up both sides
                direct(n), server(n), stream(n)
            for _ in range(args.reps):
                for key, fn, k in (("direct1", direct, 1), ("server1", server, 1), ("directN", direct, n),
                                   ("serverN", server, n), ("streamN", stream, n)):
                    wall, engine = fn(k)
                    rows[key].append(wall)
                    rows["engine_" + key].append(engine)
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()

    r = rows
    med = {k: statistics.median(v) for k, v in r.items()}
    d1 = [s - d for s, d in zip(r["server1"], r["direct1"])]
    dN = [s - d for s, d in zip(r["serverN"], r["directN"])]
    dS = [s - d for s, d in zip(r["streamN"], r["directN"])]
    per_request = statistics.median(d1)
    print(f"tiny agree model, chain mode, n={n} tokens per long request, {args.reps} rounds, "
          f"{args.threads} llama.cpp thread(s)")
    print(f"  direct Engine.generate   n=1 {1e3 * med['direct1']:7.2f} ms   n={n} {1e3 * med['directN']:8.1f} ms"
          f"   {n / med['directN']:6.1f} tok/s")
    print(f"  server /completion       n=1 {1e3 * med['server1']:7.2f} ms   n={n} {1e3 * med['serverN']:8.1f} ms"
          f"   {n / med['serverN']:6.1f} tok/s")
    print(f"  server /completion SSE                  n={n} {1e3 * med['streamN']:8.1f} ms"
          f"   {n / med['streamN']:6.1f} tok/s")
    q1, m1, q3 = quartiles(d1)
    print(f"overhead from paired differences (median [quartiles]):")
    print(f"  per request: {1e3 * m1:.2f} ms [{1e3 * q1:.2f}, {1e3 * q3:.2f}]")
    for label, d in (("whole", dN), ("streamed, one SSE event per token", dS)):
        q1, m, q3 = quartiles(d)
        print(f"  per token, {label}: {1e6 * (m - per_request) / n:.1f} us "
              f"[{1e6 * (q1 - per_request) / n:.1f}, {1e6 * (q3 - per_request) / n:.1f}]")
    print("client latency minus the engine's own timings (median):")
    for key in ("direct1", "server1", "directN", "serverN", "streamN"):
        outside = statistics.median([w - e for w, e in zip(r[key], r["engine_" + key])])
        print(f"  {key:8s} {1e3 * outside:7.2f} ms outside the engine "
              f"(engine: {1e3 * med['engine_' + key]:8.2f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
