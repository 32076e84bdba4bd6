"""Structured outputs, forced tool calls and logprobs through the real server, with the
official `ollama` client and the random-weight model."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import ollama
import pytest

from freetoken.store import Store
from tests.server.harness import LiveServer, add_model, make_config

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "temperature": {"type": "number"},
        "sunny": {"type": "boolean"},
        "hours": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
    },
    "required": ["city", "temperature", "sunny"],
}
# the ollama client keeps only some schema keywords of a tool (type, enum, properties, ...):
# free strings would let the random model write on until num_predict
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"enum": ["Paris", "Tokyo"]}, "days": {"type": "integer"}},
                "required": ["city", "days"],
            },
        },
    }
]
ASK = [{"role": "user", "content": "The weather in Paris, as JSON."}]


@pytest.mark.parametrize("seed", range(3))
def test_chat_with_a_schema_returns_an_instance(client, seed):
    r = client.chat(
        "tiny",
        messages=ASK,
        format=SCHEMA,
        options={"seed": seed, "temperature": 1.0, "num_predict": 400},
    )
    assert r.done_reason == "stop"
    jsonschema.validate(json.loads(r.message.content), SCHEMA)


def test_streamed_generate_with_a_schema(client):
    chunks = list(
        client.generate(
            "tiny",
            prompt="Weather?",
            format=SCHEMA,
            stream=True,
            options={"seed": 7, "num_predict": 400},
        )
    )
    assert chunks[-1].done and chunks[-1].done_reason == "stop"
    jsonschema.validate(json.loads("".join(c.response for c in chunks)), SCHEMA)


def test_tool_choice_option_forces_a_call(client):
    r = client.chat(
        "tiny",
        messages=ASK,
        tools=TOOLS,
        options={"tool_choice": "required", "seed": 2, "num_predict": 300},
    )
    assert r.message.tool_calls and len(r.message.tool_calls) == 1
    call = r.message.tool_calls[0].function
    assert call.name == "get_weather"
    jsonschema.validate(dict(call.arguments), TOOLS[0]["function"]["parameters"])
    assert not r.message.content.strip() and r.done_reason == "stop"


def test_logprobs_on_chat_and_generate(client):
    r = client.chat(
        "tiny",
        messages=ASK,
        logprobs=True,
        top_logprobs=3,
        options={"num_predict": 6, "temperature": 0},
    )
    assert len(r.logprobs) == r.eval_count
    assert "".join(lp.token for lp in r.logprobs) == r.message.content
    for lp in r.logprobs:
        assert lp.logprob <= 0 and len(lp.top_logprobs) == 3
        assert lp.top_logprobs[0].token == lp.token  # greedy: the likeliest token
    chunks = list(
        client.generate(
            "tiny",
            prompt="Hi",
            logprobs=True,
            stream=True,
            options={"num_predict": 4, "temperature": 0},
        )
    )
    streamed = [lp for c in chunks for lp in (c.logprobs or [])]
    assert len(streamed) == chunks[-1].eval_count
    assert all(lp.top_logprobs is None for lp in streamed)


def test_top_logprobs_out_of_range_is_a_400(client):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat("tiny", messages=ASK, logprobs=True, top_logprobs=21)
    assert e.value.status_code == 400 and e.value.error == "top_logprobs must be between 0 and 20"


def test_bad_schema_and_images_are_400(http):
    r = http.post("/api/chat", json={"model": "tiny", "messages": ASK, "format": {"type": "nope"}})
    assert r.status_code == 400
    r = http.post(
        "/api/generate", json={"model": "tiny", "prompt": "What is this?", "images": ["aGVsbG8="]}
    )
    assert r.status_code == 400 and "does not support images" in r.json()["error"]


# -- the tool_choice option, as a Modelfile sets it for agents -------------------------------

HI = [{"role": "user", "content": "Weather?"}]
# One enum argument: a forced call by the random model is short and always valid.
FORECAST = {
    "type": "function",
    "function": {
        "name": "get_forecast",
        "parameters": {
            "type": "object",
            "properties": {"unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["unit"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def forcing(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    """A server whose model has PARAMETER tool_choice "required"."""
    root = tmp_path_factory.mktemp("models")
    add_model(Store(root), "agent", parameters={"tool_choice": "required", "num_predict": 200})
    with LiveServer(make_config(root)) as srv, httpx.Client(base_url=srv.url, timeout=120) as c:
        yield c


@pytest.mark.parametrize("extra", [{}, {"tool_choice": "auto"}])
def test_the_option_forces_a_call_unless_the_request_chooses(forcing, extra):
    # the AI SDK (OpenCode) sends "auto" with every request that has tools
    r = forcing.post(
        "/v1/chat/completions",
        json={"model": "agent", "messages": HI, "tools": [FORECAST], **extra},
    )
    assert r.status_code == 200
    assert r.json()["choices"][0]["finish_reason"] == "tool_calls"
    r = forcing.post(
        "/v1/chat/completions",
        json={
            "model": "agent",
            "messages": HI,
            "tools": [FORECAST],
            "tool_choice": "none",
            "max_tokens": 4,
        },
    )
    assert r.status_code == 200 and not r.json()["choices"][0]["message"].get("tool_calls")


def test_a_forced_call_compiles_a_nullable_anyof_beside_a_type(forcing):
    # the shape of OpenClaw's tool_search parameters
    tool = {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {
                "type": "object",
                "required": ["q"],
                "properties": {
                    "q": {
                        "anyOf": [{"type": "string", "enum": ["x"]}, {"type": "null"}],
                        "type": "string",
                    }
                },
            },
        },
    }
    r = forcing.post(
        "/api/chat", json={"model": "agent", "messages": HI, "tools": [tool], "stream": False}
    )
    assert r.status_code == 200, r.text
    assert r.json()["message"]["tool_calls"][0]["function"]["arguments"] == {"q": "x"}
