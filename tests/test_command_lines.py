"""Real Step-3.5-Flash llama-server command lines, with ``llama-server`` replaced by
``python -m stepmtp.server`` and the model files by the tiny model's: each starts,
passes /health and answers a chat. The lines are the ones users' scripts carry: the
original MTP3 change's, placement (-ngl, -ncmoe, -ot), flash attention and quantized
KV, prompt caching, logging, keys and timeouts, TLS, reasoning, the n-gram drafter."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from stepmtp.tiny import write_tiny_models
from test_quantized import WIDE
from test_server import free_port, running

CHAT = {"messages": [{"role": "user", "content": "def add(a, b):"}], "max_tokens": 8, "temperature": 0}

#: name -> the command line after the binary; {M}: the model, {D}: its MTP heads' file,
#: {W}: the wide test model
LINES = {
    # the original MTP3 change's line (a split pair, every layer on the GPU when there is one)
    "seed": "-m {M} --spec-type draft-mtp --spec-draft-model {D} -ngl all --spec-draft-ngl all -c 35000 -np 1 "
            "-b 2048 -ub 1024 --temp 0 --spec-draft-n-max 3 --spec-draft-p-min 0.0",
    "moe-offload": "-m {M} -ngl 99 -ncmoe 20 -fa on --jinja -c 16384 --spec-type draft-mtp",
    "cache-reuse": "-m {M} --cache-reuse 256 --no-warmup -c 8192 -t 2 --spec-type draft-mtp",
    "quiet-keyed": "-m {M} --log-disable --metrics --api-key sk-local -c 4096",
    "timeout": "-m {M} -to 600 --threads-http 4 -c 4096 --spec-type draft-mtp --spec-draft-n-max 3",
    "reasoning": "-m {M} --jinja --reasoning-format deepseek --reasoning-budget -1 -c 32768 --temp 1.0 "
                 "--top-p 0.95 --min-p 0.0 --top-k 40",
    # (the wide test model: a quantized KV needs heads of 32 or more)
    "kv-quant": "-m {W} -ctk q8_0 -ctv q8_0 -fa on --no-mmap -c 8192",
    "slots": "-m {M} --n-cpu-moe 10 --threads 2 --threads-batch 2 --batch-size 512 --ubatch-size 512 "
             "--parallel 2 --cont-batching --kv-unified --swa-full",
    "override-tensor": "-m {M} -ot exps=CPU -ngl all --alias step-3.5-flash --chat-template-kwargs "
                       "'{{\"enable_thinking\":true}}' --slots --props",
    "ngram": "-m {M} --spec-type ngram-mod,draft-mtp --spec-draft-n-max 3 --ctx-checkpoints 8 --cache-ram 2048",
    "logging": "-m {M} -lv 3 --log-timestamps --log-prefix --log-colors off --prio 0 --poll 50 -C 0x3 "
               "--cpu-strict 0",
    "fit": "-m {M} -fit on -fitt 1024 --no-op-offload --repack --check-tensors -dev none",
}


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> Path:
    return write_tiny_models(tmp_path_factory.mktemp("wide-lines"), seed=3, cfg=WIDE)["embedded"]


def _argv(line: str, tiny: dict[str, Path], wide: Path | None = None) -> list[str]:
    import shlex

    return shlex.split(line.format(M=tiny["trunk"] if "{D}" in line else tiny["embedded"], D=tiny["mtp"], W=wide))


@pytest.mark.parametrize("name", list(LINES))
def test_a_real_command_line_serves_a_chat(name, tiny, request, tmp_path):
    argv = _argv(LINES[name], tiny, request.getfixturevalue("wide") if "{W}" in LINES[name] else None)
    headers = {"Authorization": "Bearer sk-local"} if "--api-key" in argv else {}
    with running(argv, tmp_path) as srv:
        r = httpx.post(srv.url + "/v1/chat/completions", json=CHAT, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["message"]["role"] == "assistant"
        assert body["usage"]["completion_tokens"] > 0
        if headers:  # the key is enforced
            assert httpx.post(srv.url + "/v1/chat/completions", json=CHAT, timeout=60).status_code == 401


def test_tls_line_serves_https(tiny, tmp_path):
    """--ssl-key-file / --ssl-cert-file: the same line, over HTTPS (a self-signed pair)."""
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    made = subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                           "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1"], capture_output=True)
    if made.returncode != 0:
        pytest.skip("openssl could not make a certificate here")
    port = free_port()
    log = open(tmp_path / "tls.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "stepmtp.server", "-m", str(tiny["embedded"]), "-c", "4096",
                             "--ssl-key-file", str(key), "--ssl-cert-file", str(cert), "-to", "600",
                             "--host", "127.0.0.1", "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"https://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, (tmp_path / "tls.log").read_text()[-3000:]
            try:
                if httpx.get(url + "/health", verify=False, timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "no HTTPS /health within 90 s"
                time.sleep(0.2)
        r = httpx.post(url + "/v1/chat/completions", json=CHAT, verify=False, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0
        with pytest.raises(httpx.TransportError):  # plain HTTP is not served on that port
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
    finally:
        proc.terminate()
        proc.wait(15)
        log.close()
