"""One real server per test module, with the real tiny model created in its store."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import ollama
import pytest

from freetoken.store import Store
from tests.server.harness import LiveServer, add_model, make_config

SYSTEM = "You are terse."


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("models")
    store = Store(root)
    add_model(store, "tiny", system=SYSTEM, parameters={"stop": ["<|im_end|>"]})
    add_model(store, "capped", parameters={"num_predict": 3})
    add_model(store, "endless", endless=True)
    with LiveServer(make_config(root)) as srv:
        yield srv


@pytest.fixture
def client(server: LiveServer) -> ollama.Client:
    return ollama.Client(host=server.url)


@pytest.fixture
def http(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c
