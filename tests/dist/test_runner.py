"""A runner over two CPU ranks behind the real server: it serves; a rank that dies takes the
runner down with a clear error, and the next request gets a fresh runner."""

from __future__ import annotations

import os
import signal

import httpx
import ollama
import pytest

from freetoken.store import Store
from tests.dist.util import cuda_devices
from tests.server.harness import LiveServer, add_model, make_config


@pytest.fixture(
    scope="module",
    params=[
        "cpu:2",
        pytest.param(
            "0,1",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(cuda_devices() < 2, reason="needs 2 CUDA devices"),
            ],
        ),
    ],
)
def server(tmp_path_factory, request):
    env = pytest.MonkeyPatch()
    env.setenv("FREETOKEN_GPUS", request.param)  # runners read it from the environment they inherit
    root = tmp_path_factory.mktemp("models")
    add_model(Store(root), "endless", endless=True)
    try:
        with LiveServer(make_config(root)) as srv:
            yield srv
    finally:
        env.undo()


def _ranks(server) -> list[dict]:
    runner = server.services.residency.runners()["endless:latest"]
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(runner.socket))) as rc:
        return rc.get("http://runner/stats").json()["experts"]["ranks"]


def test_a_dead_rank_stops_the_runner_and_the_next_request_recovers(server):
    client = ollama.Client(host=server.url)
    assert client.generate("endless", prompt="hi", options={"num_predict": 3}).done
    ranks = _ranks(server)
    devices = (
        ["cpu", "cpu"] if os.environ["FREETOKEN_GPUS"].startswith("cpu") else ["cuda:0", "cuda:1"]
    )
    assert [(r["rank"], r["device"], r["experts"]) for r in ranks] == [
        (0, devices[0], [0, 2]),
        (1, devices[1], [2, 4]),
    ]
    first = server.runner_pid("endless:latest")
    stream = client.generate("endless", prompt="go", stream=True, options={"num_predict": 100000})
    next(stream)
    os.kill(ranks[1]["pid"], signal.SIGKILL)
    why = rf"rank 1 \(pid {ranks[1]['pid']}, {devices[1]}\) exited with status -9; the runner exits"
    with pytest.raises(
        ollama.ResponseError,
        match=rf"model runner has unexpectedly stopped \(exit status 1\): .*{why}",
    ):
        for _ in stream:
            pass
    out = client.chat(
        "endless", messages=[{"role": "user", "content": "hi"}], options={"num_predict": 2}
    )
    assert out.done and server.runner_pid("endless:latest") != first
    assert len(_ranks(server)) == 2
