"""The server under misuse and load (loopback only, bounded in count and time):
property-based fuzzing of every route from its own OpenAPI spec, and concurrent
streaming clients with disconnects and bad requests mixed in."""
from __future__ import annotations

import asyncio
import json
import random
import shutil
import subprocess
import sys

import httpx
import psutil
import pytest

from stepmtp.tiny import write_agree_model
from tests.test_server import running

PROMPTS = ["import os\n", "def main(argv):\n", "class A:\n    pass\n", "for i in range(3):\n"]
N = 12


@pytest.fixture(scope="module")
def agree(tmp_path_factory):
    return write_agree_model(tmp_path_factory.mktemp("agree-load"), seed=0)[0]


@pytest.fixture(scope="module")
def server(agree, tmp_path_factory):
    # the context pool is a cache bounded in tokens (256k by default, ~40 MB): a small
    # bound fills within the first 100 requests, so growth after them is a leak, not the pool
    args = ["-m", str(agree), "--spec-type", "draft-mtp", "-c", "2048", "-np", "4", "-t", "1",
            "--spec-context-pool", "1024"]
    with running(args, tmp_path_factory.mktemp("load")) as srv:
        yield srv


@pytest.fixture(scope="module")
def small(agree, tmp_path_factory):
    """A short context: what fuzzed requests generate stays short."""
    # slot files on, so that the slot routes are exercised, not refused (501 as llama-server)
    slots = tmp_path_factory.mktemp("fuzz-slots")
    args = ["-m", str(agree), "--spec-type", "draft-mtp", "-c", "256", "-np", "2", "-t", "1",
            "--slot-save-path", str(slots), "--props"]  # and POST /props answered, not 501
    with running(args, tmp_path_factory.mktemp("fuzz")) as srv:
        yield srv


def test_fuzz_every_route_no_5xx(small):
    server = small
    """schemathesis generates requests for every operation of /openapi.json (valid and
    not): none may get a 5xx, and the server is healthy afterwards."""
    st = shutil.which("st") or shutil.which("schemathesis")
    if st is None:
        pytest.skip("schemathesis is not installed (pip install '.[test]')")
    r = subprocess.run([st, "run", server.url + "/openapi.json", "-c", "not_a_server_error", "-n", "3",
                        "--phases", "coverage,fuzzing", "--no-color", "--seed", "1"],
                       capture_output=True, text=True, timeout=900)
    summary = r.stdout[-1500:]
    assert r.returncode == 0, summary + r.stderr[-1500:]
    assert "generated" in summary and " failed" not in summary.split("Test cases:")[-1].split("\n")[1], summary
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


async def _load(url: str, n: int, want: dict[str, str], seed: int) -> dict[str, int]:
    """n requests from 8 concurrent clients: most stream to the end and are checked
    against the text each prompt gives alone; some hang up after two events; some are
    malformed."""
    rnd = random.Random(seed)
    counts = {"ok": 0, "dropped": 0, "bad": 0, "errors": 0}

    async def one(client: httpx.AsyncClient, i: int) -> None:
        kind = rnd.random()
        prompt = rnd.choice(PROMPTS)
        if kind < 0.1:
            r = await client.post(url + "/completion", content=b'{"prompt": ', headers={"content-type": "x"})
            counts["bad" if r.status_code == 400 else "errors"] += 1
            return
        body = {"prompt": prompt, "n_predict": N, "temperature": 0, "stream": True}
        async with client.stream("POST", url + "/completion", json=body) as r:
            if r.status_code != 200:
                counts["errors"] += 1
                return
            text, events = "", 0
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                events += 1
                if kind < 0.25 and events == 2:
                    counts["dropped"] += 1  # the client goes away mid-stream
                    return
                ev = json.loads(line[6:])
                text += ev.get("content", "")
                if ev.get("stop"):
                    break
        counts["ok" if text == want[prompt] else "errors"] += 1

    async with httpx.AsyncClient(timeout=120) as client:
        sem = asyncio.Semaphore(8)

        async def limited(i: int) -> None:
            async with sem:
                await one(client, i)

        await asyncio.gather(*(limited(i) for i in range(n)))
    return counts


def test_load_with_disconnects_and_bad_requests(server):
    want = {}
    for p in PROMPTS:
        r = httpx.post(server.url + "/completion", json={"prompt": p, "n_predict": N, "temperature": 0}, timeout=60)
        want[p] = r.json()["content"]
    proc = psutil.Process(server.proc.pid)
    first = asyncio.run(_load(server.url, 100, want, seed=1))
    rss_100 = proc.memory_info().rss
    rest = asyncio.run(_load(server.url, 900, want, seed=2))
    rss_1000 = proc.memory_info().rss
    total = {k: first[k] + rest[k] for k in first}
    print(f"load: {sum(total.values())} requests, {total}; RSS after 100: {rss_100 >> 20} MiB, "
          f"after 1000: {rss_1000 >> 20} MiB", file=sys.stderr)
    assert total["errors"] == 0, total
    assert total["ok"] > 500 and total["dropped"] > 50 and total["bad"] > 50, total
    assert rss_1000 <= rss_100 * 1.05, (rss_100, rss_1000)
    # every slot free, nothing waiting
    slots = httpx.get(server.url + "/slots", timeout=10).json()
    assert not any(s["is_processing"] for s in slots)
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    assert "llamacpp:requests_processing 0" in metrics and "llamacpp:requests_deferred 0" in metrics
