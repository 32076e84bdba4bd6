"""Real clients (ollama-js, OpenCode, OpenClaw) against the real server on loopback.

Each client is installed from npm at test time, at a pinned version, into a cache folder
(under the pytest cache, so later runs reuse it; a temporary folder when the cache plugin is
off); all four take about a minute from nothing. A test skips, saying why, only when
Node.js or npm is missing, the registry does not answer a ping, or an install fails or runs
past five minutes (then no later install is tried).

One server serves every test here. Its store holds two models made from one random-weight
Qwen3-MoE with a 64k context (agent prompts run to 16k tokens):
- `tiny`: plain, with short answers;
- `agent`: PARAMETER tool_choice "required", so while the conversation's last message is not
  a tool result the model must answer with one well-formed tool call (constrained decoding);
  after the tool result it answers (the harness sends `tool_choice: "none"` then, as a random
  model may otherwise open another call). An agent loop thus gets exactly one tool call.
A recording middleware keeps every request and response, so a test can check what the
client sent and what it got back.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from freetoken.store import CreateSpec, Store
from tests.clients.harness import AnswersAfterTools, Log, Recorder, Served
from tests.fixtures import SYNTH_TINY
from tests.server.harness import LiveServer, make_config

# A random-weight model pads its forced tool call with the whitespace the grammar allows
# (about 100 tokens for a one-argument call); 512 leaves room to spare.
AGENT_PARAMETERS = {"tool_choice": "required", "num_predict": 512, "num_ctx": 65536}


@pytest.fixture(scope="session")
def tools_root(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = getattr(request.config, "cache", None)
    if cache is not None:
        return Path(cache.mkdir("freetoken-clients"))
    return tmp_path_factory.mktemp("freetoken-clients")


@pytest.fixture(scope="session")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    from freetoken.tools import synth

    work = tmp_path_factory.mktemp("client-models")
    model_dir = synth.write_qwen3_moe(
        work / "tiny-64k", **{**SYNTH_TINY, "max_position_embeddings": 65536}
    )
    store = Store(work / "store")
    for name, params in (("tiny", {"num_predict": 24}), ("agent", AGENT_PARAMETERS)):
        for _ in store.plan_create(
            CreateSpec(name=name, from_=str(model_dir), parameters=params)
        ).run():
            pass
    server = LiveServer(make_config(work / "store"))
    log = Log()
    # the recorder, added last, is outermost: it logs what the client sent
    server.app.add_middleware(AnswersAfterTools)
    server.app.add_middleware(Recorder, log=log)
    with server:
        yield Served(server, log)


@pytest.fixture
def seen(served: Served) -> Log:
    """The server's log, emptied for this test."""
    served.log.clear()
    return served.log
