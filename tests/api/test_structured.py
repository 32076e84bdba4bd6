"""Structured outputs, forced tool calls and logprobs through the real server, with the
official `ollama` client and the random-weight model; a call the token limit cut, as each
API reports it (scripted runner events, and the random model cut short)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import ollama
import pytest

from freetoken.store import Store
from tests.api.conftest import done_event
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
    # a keyword the engine cannot enforce is named, never passed over
    bad = {"type": "object", "properties": {"ids": {"type": "array", "uniqueItems": True}}}
    r = http.post("/api/chat", json={"model": "tiny", "messages": ASK, "format": bad})
    assert r.status_code == 400 and "uniqueItems" in r.json()["error"]
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}
    r = http.post(
        "/v1/chat/completions", json={"model": "tiny", "messages": ASK, "response_format": fmt}
    )
    assert r.status_code == 400 and "keyword not" in r.json()["error"]["message"]
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


# -- a call the token limit cut -------------------------------------------------------------

CUT = {"index": 0, "name": "get_weather", "arguments": '{"city": "Par'}
CUT_EVENTS = [{"content": "Checking. "}, {"tool_call_truncated": CUT}, done_event("length")]


def test_a_cut_call_is_reported_as_cut_on_every_api(http, script):
    script(CUT_EVENTS)
    body = {"model": "tiny", "messages": ASK, "tools": TOOLS, "stream": False}
    # Ollama's calls carry whole arguments: the cut one is left out, done_reason says why
    out = http.post("/api/chat", json=body).json()
    assert out["message"]["content"] == "Checking. " and not out["message"].get("tool_calls")
    assert out["done_reason"] == "length"
    # OpenAI's: the call with its arguments as far as they got, finish_reason "length"
    choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] == "Checking. "
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Par'}
    # Responses: an incomplete function_call item in an incomplete response
    answer = http.post(
        "/v1/responses", json={"model": "tiny", "input": "hi", "tools": [_flat(TOOLS[0])]}
    ).json()
    [item] = [o for o in answer["output"] if o["type"] == "function_call"]
    assert answer["status"] == "incomplete" and item["status"] == "incomplete"
    assert (item["name"], item["arguments"]) == ("get_weather", '{"city": "Par')
    # Anthropic's tool_use needs a whole input: left out, stop_reason max_tokens
    tools = [{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}]
    message = http.post(
        "/v1/messages", json={"model": "tiny", "max_tokens": 9, "messages": ASK, "tools": tools}
    ).json()
    assert message["stop_reason"] == "max_tokens"
    assert message["content"] == [{"type": "text", "text": "Checking. "}]


def test_a_streamed_cut_call_streams_its_partial_arguments(http, script):
    script(CUT_EVENTS)
    body = {"model": "tiny", "messages": ASK, "tools": TOOLS, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line[6:7] == "{"]
    deltas = [d for c in chunks for ch in c["choices"] for d in ch["delta"].get("tool_calls", [])]
    assert "".join(d["function"].get("arguments", "") for d in deltas) == '{"city": "Par'
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def _flat(tool):
    return {"type": "function", **tool["function"]}


def test_a_forced_call_the_random_model_cannot_finish_comes_back_cut(http):
    body = {"model": "tiny", "messages": ASK, "tools": TOOLS, "tool_choice": "required"}
    choice = http.post("/v1/chat/completions", json={**body, "max_tokens": 8}).json()["choices"][0]
    assert choice["finish_reason"] == "length" and not choice["message"]["content"]
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] in ("", "get_weather")
    with pytest.raises(ValueError):
        json.loads(call["function"]["arguments"])  # partial: never passed off as whole


DAYS = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Tokyo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
            },
            "required": ["city", "days"],
        },
    },
}


@pytest.mark.parametrize("seed", range(2))
def test_parallel_forced_calls_each_follow_the_schema(http, seed):
    body = {"model": "tiny", "messages": ASK, "tools": [DAYS], "tool_choice": "required"}
    body |= {"parallel_tool_calls": True, "seed": seed, "temperature": 1.0, "max_tokens": 120}
    choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    calls = choice["message"]["tool_calls"]
    whole = calls[:-1] if choice["finish_reason"] == "length" else calls
    assert whole and not choice["message"]["content"]
    for call in whole:
        args = json.loads(call["function"]["arguments"])
        jsonschema.validate(args, DAYS["function"]["parameters"])
