"""The generation service the server's routes share (``server/service.py``), driven
without FastAPI or a socket: a request into the worker's jobs, then its results or its
stream, as the engine alone would generate them; a client that leaves; what it refuses."""
from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from stepmtp import Engine
from stepmtp.server.config import ServerConfig
from stepmtp.api.errors import APIError
from stepmtp.api.schemas import CompletionRequest
from stepmtp.server.service import ClientGone, GenerationService
from stepmtp.server.state import ServerState
from stepmtp.server.worker import Channel, Job
from stepmtp.tiny import write_agree_model

PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n"
N = 24
N_CTX = 4096


class Client:
    """What the service needs of a request: whether its client left."""

    def __init__(self, gone: bool = False) -> None:
        self.gone = gone

    async def is_disconnected(self) -> bool:
        return self.gone


@pytest.fixture(scope="module")
def agree(tmp_path_factory: pytest.TempPathFactory):
    return write_agree_model(tmp_path_factory.mktemp("agree"), seed=0)[0]


@pytest.fixture(scope="module")
def service(agree):
    st = ServerState(ServerConfig(model=str(agree), spec_type="draft-mtp", n_ctx=N_CTX, n_parallel=1, n_threads=1))
    st.load()  # what the server's loading thread runs
    assert st.ready.is_set(), st.failed
    try:
        yield GenerationService(st)
    finally:
        st.close()


@pytest.fixture(scope="module")
def direct(agree):
    with Engine(agree, mode="chain", n_ctx=N_CTX, n_threads=1) as eng:
        yield eng.generate(PROMPT, n_predict=N, temperature=0)


def completion_jobs(svc: GenerationService, body: dict, stream: bool = False):
    async def jobs():
        req = CompletionRequest.model_validate(body)
        return await svc.prepare(req, await svc.prompt_tokens(req.prompt), stream=stream)
    return jobs()


def test_results_are_the_engines(service, direct):
    async def run():
        gens, settings = await completion_jobs(service, {"prompt": PROMPT, "n_predict": N, "temperature": 0})
        assert settings.n_predict == N and len(gens) == 1
        return await service.results(gens, Client())

    (c,) = asyncio.run(run())
    assert c.tokens == direct.tokens and c.text == direct.text


def test_a_stream_carries_the_same_text(service, direct):
    async def run():
        gens, _ = await completion_jobs(service, {"prompt": PROMPT, "n_predict": N, "temperature": 0}, stream=True)
        job, items = await service.start(gens[0], Client())
        events = service.stream_events(job, items, lambda ch: [ch.text], lambda c: [f"<done {len(c.tokens)}>"],
                                       done_marker=False)
        return "".join([s async for s in events])

    assert asyncio.run(run()) == direct.text + f"<done {N}>"


def test_a_client_gone_cancels_its_waiting_job(service):
    async def run():
        gens, _ = await completion_jobs(service, {"prompt": PROMPT, "n_predict": N})
        job = Job(gens[0], Channel(asyncio.get_running_loop()))  # never submitted: nothing comes
        with pytest.raises(ClientGone):  # the deadline only turns a hang into a failure
            await asyncio.wait_for(service.run_all([job], Client(gone=True)), 60)
        return job

    assert asyncio.run(run()).cancelled.is_set()


@pytest.mark.parametrize("body, message", [
    ({"prompt": "x", "stop": ["a"] * 100}, "--max-stop"),
    ({"prompt": [10**8]}, "is out of range"),
    ({"prompt": [1] * N_CTX}, "exceeds the available context size"),
    ({"prompt": "x", "n": 2}, "the server's -np"),
])
def test_prepare_refuses_as_llama_server(service, body, message):
    with pytest.raises(APIError) as e:
        asyncio.run(completion_jobs(service, body))
    assert message in e.value.message and 400 <= e.value.code < 500


def test_the_service_needs_no_fastapi():
    code = ("import sys, stepmtp.server.service; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'fastapi'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
