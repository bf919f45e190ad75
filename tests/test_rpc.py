"""ggml's RPC backend: two ``rpc-server`` processes on 127.0.0.1 started (and stopped)
here. Output over RPC equals local output at temperature 0 (plain and chained MTP, one
file and a split pair); a dead server is an RPCError naming it, quickly, with the
process still able to close the model and run a local one; the server and the bench
take ``--rpc``."""
from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stepmtp import Engine, Model, rpc
from stepmtp.rpc import RPCError, parse_servers, probe, rpc_server_path
from stepmtp.tiny import write_agree_model

PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n"
N = 24
N_CTX = 512

pytestmark = pytest.mark.skipif(not rpc.rpc_available(), reason="built with -DSTEPMTP_RPC=off")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RPCServer:
    """``rpc-server -H 127.0.0.1 -p PORT -t 1``, ready once it answers the handshake."""

    def __init__(self, port: int | None = None) -> None:
        for _ in range(3):  # another process may take the free port meanwhile
            self.port = port or free_port()
            self.endpoint = f"127.0.0.1:{self.port}"
            self.proc = subprocess.Popen([str(rpc_server_path()), "-H", "127.0.0.1", "-p", str(self.port), "-t", "1"],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if self._wait_ready():
                return
            self.stop()
            if port:
                break
        raise RuntimeError(f"rpc-server on {self.endpoint} did not start")

    def _wait_ready(self, timeout: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                probe(self.endpoint, timeout=2.0)
                return True
            except RPCError:
                time.sleep(0.05)
        return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture(scope="module")
def servers():
    pair = [RPCServer(), RPCServer()]
    yield pair
    for s in pair:
        s.stop()


@pytest.fixture(scope="module")
def endpoints(servers) -> str:
    return ",".join(s.endpoint for s in servers)


@pytest.fixture(scope="module")
def agree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Drafts partly accepted: the chained heads really run over RPC."""
    return write_agree_model(tmp_path_factory.mktemp("agree"), seed=0)[0]


def generate(model: Path, mode: str, **kw) -> tuple[list[int], int]:
    # a fixed draft length: its counts are compared
    with Engine(model, mode=mode, n_ctx=N_CTX, adaptive=False, **kw) as eng:
        out = eng.generate(PROMPT, n_predict=N, temperature=0)
        return out.tokens, out.stats.n_accepted


# -- output ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["none", "chain"])
def test_output_equals_local(agree, endpoints, mode, caplog):
    local, acc_local = generate(agree, mode)
    with caplog.at_level(logging.INFO, logger="stepmtp.llama"):
        remote, acc_remote = generate(agree, mode, rpc=endpoints, n_gpu_layers="all")
    assert remote == local and len(local) == N
    assert acc_remote == acc_local
    if mode == "chain":
        assert acc_local > 0
    log = "\n".join(r.getMessage() for r in caplog.records)
    # every layer left the CPU, and weights went to both servers
    assert "offloaded" in log and "layers to GPU" in log
    for ep in endpoints.split(","):
        assert f"[{ep}]" in log, log[-3000:]


def test_split_pair_target_and_draft_over_rpc(tiny, endpoints):
    """The MTP file of a split pair is the draft model: on the servers too."""
    local, _ = generate(tiny["trunk"], "chain", mtp_model=tiny["mtp"])
    with Engine(tiny["trunk"], mtp_model=tiny["mtp"], mode="chain", n_ctx=N_CTX, rpc=endpoints,
                n_gpu_layers="all") as eng:
        assert eng.model.rpc is not None and eng.draft_model.rpc is not None
        assert eng.generate(PROMPT, n_predict=N, temperature=0).tokens == local


def test_same_server_twice_adds_no_devices(tiny, servers):
    a, b = servers[0].endpoint, servers[1].endpoint
    with Model(tiny["embedded"], rpc=f"{a},{b},{a}", n_gpu_layers="all") as m1, \
            Model(tiny["embedded"], rpc=[b, a], n_gpu_layers=1) as m2:
        assert len(m1.rpc.device_names) == 2 and len(set(m1.rpc.device_names)) == 2
        assert sorted(m2.rpc.device_names) == sorted(m1.rpc.device_names)
    with Model(tiny["embedded"], rpc=a, n_gpu_layers="all") as m3:
        assert m3.rpc.device_names == [m1.rpc.device_names[0]]


def test_parse_servers():
    assert parse_servers("h:1, h2:50052 ,h:1,") == ["h:1", "h2:50052"]
    assert parse_servers(None) == [] and parse_servers("") == []
    assert parse_servers(["10.0.0.1:7", "10.0.0.1:07"]) == ["10.0.0.1:7"]
    for bad in ("host", "host:", ":50052", "h:port", "h:0", "h:70000"):
        with pytest.raises(ValueError, match="host:port"):
            parse_servers(bad)


# -- failures ------------------------------------------------------------------------------


def test_nothing_listening(tiny):
    dead = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(RPCError, match=f"{dead}: connection refused"):
        Engine(tiny["embedded"], mode="chain", n_ctx=N_CTX, rpc=dead, n_gpu_layers="all")
    assert time.monotonic() - t0 < 5
    tokens, _ = generate(tiny["embedded"], "chain")  # the process is fine
    assert len(tokens) == N


def test_silent_listener_times_out(tiny, monkeypatch):
    """A port that accepts but never answers (not an rpc-server, or one busy with
    another client) fails after the probe timeout instead of hanging."""
    monkeypatch.setattr(rpc, "PROBE_TIMEOUT_S", 0.5)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as lsn:
        lsn.bind(("127.0.0.1", 0))
        lsn.listen(4)  # the kernel completes connections; nobody reads
        ep = f"127.0.0.1:{lsn.getsockname()[1]}"
        t0 = time.monotonic()
        with pytest.raises(RPCError, match=f"{ep}: accepted the connection but did not answer"):
            Model(tiny["embedded"], rpc=ep, n_gpu_layers="all")
        assert time.monotonic() - t0 < 5


def test_server_killed_mid_session(tiny):
    pair = [RPCServer(), RPCServer()]
    try:
        eps = ",".join(s.endpoint for s in pair)
        eng = Engine(tiny["embedded"], mode="chain", n_ctx=N_CTX, rpc=eps, n_gpu_layers="all")
        first = eng.generate(PROMPT, n_predict=8, temperature=0).tokens
        pair[1].stop()
        t0 = time.monotonic()
        with pytest.raises(RPCError, match=f"lost the connection to RPC server {pair[1].endpoint}"):
            eng.generate(PROMPT, n_predict=8, temperature=0)
        assert time.monotonic() - t0 < 10
        with pytest.raises(RPCError):  # and again: the model stays unusable, not undefined
            eng.generate(PROMPT, n_predict=8, temperature=0)
        eng.close()  # freeing buffers on the dead server must not abort
        with pytest.raises(RPCError, match=f"{pair[1].endpoint}: connection refused"):
            Engine(tiny["embedded"], mode="chain", n_ctx=N_CTX, rpc=eps, n_gpu_layers="all")
        # a later local engine works, and so does the server once it is back
        local, _ = generate(tiny["embedded"], "chain")
        assert local[:8] == first
        pair[1] = RPCServer(pair[1].port)
        again, _ = generate(tiny["embedded"], "chain", rpc=eps, n_gpu_layers="all")
        assert again == local
    finally:
        for s in pair:
            s.stop()


# -- the command lines -----------------------------------------------------------------------


def test_rpc_server_module_runs_the_binary():
    r = subprocess.run([sys.executable, "-m", "stepmtp.rpc_server", "--help"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and "--port PORT" in r.stderr and "--cache" in r.stderr


def test_server_cli_flag(monkeypatch):
    from stepmtp.server.cli import parse_args

    assert parse_args(["--rpc", "a:1,b:2"]).rpc == ["a:1", "b:2"]
    assert parse_args([]).rpc == []
    monkeypatch.setenv("LLAMA_ARG_RPC", "c:3")
    assert parse_args([]).rpc == ["c:3"]
    assert parse_args(["--rpc", "d:4"]).rpc == ["d:4"]
    with pytest.raises(SystemExit) as e:
        parse_args(["--rpc", "nohost"])
    assert e.value.code == 2


def _server(args: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_ARG_")}
    proc = subprocess.Popen([sys.executable, "-m", "stepmtp.server", *args, "--host", "127.0.0.1", "--port",
                             str(port)], stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env)
    return proc, f"http://127.0.0.1:{port}"


def test_http_server_over_rpc(agree, tmp_path):
    """The server with --rpc answers as the engine does locally; a lost server turns
    requests into 500s naming it; a dead one at start is a failed start, not a hang."""
    import httpx

    local, _ = generate(agree, "chain")
    pair = [RPCServer(), RPCServer()]
    proc, url = _server(["-m", str(agree), "--spec-type", "draft-mtp", "-c", str(N_CTX), "-np", "1", "-t", "1",
                         "--temp", "0", "--rpc", ",".join(s.endpoint for s in pair), "-ngl", "all"],
                        tmp_path / "srv.log")
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, (tmp_path / "srv.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "server did not become ready"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        body = {"prompt": PROMPT, "n_predict": N, "temperature": 0, "return_tokens": True}
        r = httpx.post(f"{url}/completion", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["tokens"] == local
        pair[0].stop()
        r = httpx.post(f"{url}/completion", json=body, timeout=60)
        assert r.status_code == 500 and pair[0].endpoint in r.json()["error"]["message"]
        # and the server says it is unhealthy, so that a load balancer drains it
        h = httpx.get(f"{url}/health", timeout=10)
        assert h.status_code == 503 and pair[0].endpoint in h.json()["error"]["message"]
    finally:
        proc.terminate()
        proc.wait(30)
        for s in pair:
            s.stop()

    dead = f"127.0.0.1:{free_port()}"
    proc, _ = _server(["-m", str(agree), "--rpc", dead, "-ngl", "all"], tmp_path / "dead.log")
    assert proc.wait(60) == 1
    assert f"{dead}: connection refused" in (tmp_path / "dead.log").read_text()


def test_bench_runs_over_rpc(agree, endpoints, tmp_path):
    from stepmtp.bench.__main__ import main as bench_main

    out = tmp_path / "bench.json"
    rc = bench_main(["-m", str(agree), "--configs", "chain-3", "--categories", "code_python", "-n", "16", "-t", "1",
                     "--rpc", endpoints, "--rpc-vs-local", "--json", str(out), "--no-progress", "-q"])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["settings"]["rpc"] == endpoints
    assert doc["identical_outputs"]
    assert [c["label"] for c in doc["configs"]] == ["chain-3", "rpc-chain-3"]
