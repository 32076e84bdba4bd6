"""One real server per test module, with the real tiny model created in its store."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import ollama
import openai
import pytest

from freetoken.api import completion
from freetoken.protocol import CompletionRequest
from freetoken.server.runner import RunnerError
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


# -- the /v1 routes (OpenAI, Anthropic, Responses) -----------------------------------------

# A Jinja TEMPLATE whose generation prompt opens a thinking section: whatever the random
# model writes is thinking, so reasoning output can be tested end to end.
THINK_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call tools.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n<think>\n"
)


@pytest.fixture(scope="module")
def v1_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    root = tmp_path_factory.mktemp("models")
    store = Store(root)
    add_model(store, "tiny", parameters={"stop": ["<|im_end|>"]})
    add_model(store, "thinker", template=THINK_TEMPLATE)
    add_model(store, "endless", endless=True)
    store.copy("tiny", "team/tiny:v1")
    with LiveServer(make_config(root)) as srv:
        yield srv


@pytest.fixture
def oai(v1_server: LiveServer) -> openai.OpenAI:
    """The real OpenAI SDK pointed at the server's /v1 routes."""
    return openai.OpenAI(base_url=v1_server.url + "/v1", api_key="ollama", max_retries=0)


@pytest.fixture
def v1_http(v1_server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=v1_server.url, timeout=60) as c:
        yield c


@pytest.fixture
def script(monkeypatch: pytest.MonkeyPatch) -> Callable[..., list[dict[str, Any]]]:
    """Stands a script in for the runner's events: `script(events, pause=s)` makes every
    completion route stream `events` (an event {"raise": msg} fails there, as a dying runner
    would) and returns the list that collects the runner requests the routes built. The
    model is still resolved and checked as usual."""

    def use(events: list[dict[str, Any]], pause: float = 0.0) -> list[dict[str, Any]]:
        bodies: list[dict[str, Any]] = []

        async def scripted(
            svc: Any, plan: Any, keep_alive: Any, body: CompletionRequest
        ) -> AsyncIterator[dict[str, Any]]:
            bodies.append(body.to_json())  # as the runner would receive it
            for ev in events:
                await asyncio.sleep(pause)
                if "raise" in ev:
                    raise RunnerError(ev["raise"])
                yield ev

        monkeypatch.setattr(completion, "events", scripted)
        return bodies

    return use


def done_event(reason: str = "stop", prompt: int = 7, generated: int = 5) -> dict[str, Any]:
    return {
        "done": True,
        "done_reason": reason,
        "prompt_eval_count": prompt,
        "eval_count": generated,
        "total_ns": 1,
        "load_ns": 0,
    }


# A scripted answer with everything in it: thinking, text, then two tool calls.
SCRIPT = [
    {"thinking": "The user wants "},
    {"thinking": "the weather."},
    {"content": "Let me check."},
    {
        "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"city": "Tōkyō", "unit": "c"}}}
        ]
    },
    {
        "tool_calls": [
            {"function": {"name": "get_time", "arguments": {"zone": "Asia/Tokyo", "n": [1, 2]}}}
        ]
    },
    done_event(),
]


def parse_sse(raw: bytes) -> list[tuple[str | None, str]]:
    """(event name, data) of each frame of a server-sent event stream."""
    frames = []
    for block in raw.decode().split("\n\n"):
        if not block.strip():
            continue
        name, data = None, []
        for line in block.split("\n"):
            key, _, value = line.partition(": ")
            if key == "event":
                name = value
            elif key == "data":
                data.append(value)
        frames.append((name, "\n".join(data)))
    return frames


async def _drain(frames: AsyncIterator[bytes]) -> bytes:
    return b"".join([f async for f in frames])


def render(frames: AsyncIterator[bytes]) -> bytes:
    """All the frames of a stream builder, run to its end."""
    return asyncio.run(_drain(frames))


async def _aiter(items: list[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
    for item in items:
        if "raise" in item:
            raise RunnerError(item["raise"])
        yield item


def events_of(items: list[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
    """A runner event stream that plays `items`."""
    return _aiter(items)
