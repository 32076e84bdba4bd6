"""Anthropic Messages with the real `anthropic` SDK, against the real server.

Tool use is tested with scripted runner events (the tiny random model never calls a tool);
stop reasons, usage, thinking, count_tokens and errors also run on the real model.
"""

import json

import anthropic
import pytest

from freetoken.api import anthropic as messages_api
from freetoken.api.anthropic import MessageStream

from .conftest import SCRIPT, done_event, events_of, parse_sse, render

HI = [{"role": "user", "content": "Why is the sky blue?"}]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}


@pytest.fixture
def claude(v1_server):
    return anthropic.Anthropic(base_url=v1_server.url, api_key="sk-ignored", max_retries=0)


# -- the stream builder, fed scripted events --------------------------------------------


def test_event_grammar_of_a_streamed_message():
    frames = parse_sse(render(MessageStream("m").frames(events_of(SCRIPT))))
    names = [name for name, _ in frames]
    data = [json.loads(d) for _, d in frames]
    assert all(d["type"] == name for name, d in zip(names, data))
    assert names[:2] == ["message_start", "ping"]
    assert names[-2:] == ["message_delta", "message_stop"]
    starts = [d for d in data if d["type"] == "content_block_start"]
    assert [(s["index"], s["content_block"]["type"]) for s in starts] == [
        (0, "thinking"),
        (1, "text"),
        (2, "tool_use"),
        (3, "tool_use"),
    ]
    stops = [d["index"] for d in data if d["type"] == "content_block_stop"]
    assert stops == [0, 1, 2, 3]
    # each block's deltas fall between its start and its stop
    for i in range(4):
        at = [k for k, d in enumerate(data) if d.get("index") == i]
        assert data[at[0]]["type"] == "content_block_start"
        assert data[at[-1]]["type"] == "content_block_stop"
    pieces = [d["delta"]["partial_json"] for d in data if d.get("index") == 2 and "delta" in d]
    assert len(pieces) > 1 and "".join(pieces) == '{"city":"Tōkyō","unit":"c"}'
    assert data[-2]["delta"]["stop_reason"] == "tool_use"
    assert data[-2]["usage"] == {
        "input_tokens": 7,
        "cache_read_input_tokens": 0,
        "output_tokens": 5,
    }


@pytest.mark.parametrize(
    "reason, expected", [("stop", "end_turn"), ("length", "max_tokens"), ("other", "stop_sequence")]
)
def test_stop_reasons(reason, expected):
    frames = parse_sse(
        render(MessageStream("m").frames(events_of([{"content": "x"}, done_event(reason)])))
    )
    assert json.loads(frames[-2][1])["delta"]["stop_reason"] == expected


# -- scripted runner events through the real server --------------------------------------


def test_sdk_accumulates_a_scripted_streamed_tool_use(claude, script):
    bodies = script(SCRIPT)
    with claude.messages.stream(
        model="tiny",
        max_tokens=100,
        messages=HI,
        tools=[WEATHER],
        tool_choice={"type": "any"},
        thinking={"type": "disabled"},
    ) as stream:
        message = stream.get_final_message()
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use", "tool_use"]
    thinking, text, weather, clock = message.content
    assert thinking.thinking == "The user wants the weather." and text.text == "Let me check."
    assert weather.name == "get_weather" and weather.input == {"city": "Tōkyō", "unit": "c"}
    assert clock.input == {"zone": "Asia/Tokyo", "n": [1, 2]}
    assert weather.id.startswith("toolu_") and weather.id != clock.id
    assert message.stop_reason == "tool_use"
    assert (message.usage.input_tokens, message.usage.output_tokens) == (7, 5)
    [body] = bodies
    assert body["tool_choice"] == "required" and body["think"] is False
    assert body["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather in a city",
                "parameters": WEATHER["input_schema"],
            },
        }
    ]


def test_non_streamed_tool_use(claude, script):
    script(SCRIPT)
    message = claude.messages.create(model="tiny", max_tokens=100, messages=HI, tools=[WEATHER])
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert message.content[2].input == {"city": "Tōkyō", "unit": "c"}
    assert message.stop_reason == "tool_use" and message.type == "message"


@pytest.mark.parametrize(
    "choice, expected",
    [
        ({"type": "auto"}, "auto"),
        (
            {"type": "tool", "name": "get_weather"},
            {"type": "function", "function": {"name": "get_weather"}},
        ),
    ],
)
def test_tool_choice_is_passed_on(claude, script, choice, expected):
    bodies = script([done_event()])
    claude.messages.create(
        model="tiny", max_tokens=5, messages=HI, tools=[WEATHER], tool_choice=choice
    )
    assert bodies[0]["tool_choice"] == expected


def test_tool_choice_none_offers_no_tools(claude, script):
    bodies = script([done_event()])
    claude.messages.create(
        model="tiny", max_tokens=5, messages=HI, tools=[WEATHER], tool_choice={"type": "none"}
    )
    assert bodies[0]["tools"] is None and "tool_choice" not in bodies[0]


TOOL_USE = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Tokyo"}}
TOOL_RESULT = {
    "type": "tool_result",
    "tool_use_id": "toolu_1",
    "content": [{"type": "text", "text": "22C"}],
}


def test_conversation_translation(claude, script):
    bodies = script([done_event()])
    # "thinker": only a model whose template can think may be asked to
    claude.messages.create(
        model="thinker",
        max_tokens=7,
        system=[{"type": "text", "text": "You help."}, {"type": "text", "text": "Be brief."}],
        stop_sequences=["END"],
        thinking={"type": "enabled", "budget_tokens": 1024},
        # newer SDKs dropped these arguments; older clients still send them
        extra_body={"temperature": 0.3, "top_p": 0.8, "top_k": 5},
        messages=[
            {"role": "user", "content": "Weather in Tokyo?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Look it up.", "signature": "sig"},
                    {"type": "text", "text": "Checking."},
                    TOOL_USE,
                ],
            },
            {"role": "user", "content": [TOOL_RESULT, {"type": "text", "text": "Thanks"}]},
        ],
    )
    [body] = bodies
    call = {"index": 0, "name": "get_weather", "arguments": {"city": "Tokyo"}}
    assert body["messages"] == [
        {"role": "system", "content": "You help.\n\nBe brief."},
        {"role": "user", "content": "Weather in Tokyo?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "thinking": "Look it up.",
            "tool_calls": [{"id": "toolu_1", "function": call}],
        },
        {"role": "tool", "content": "22C", "tool_call_id": "toolu_1", "tool_name": "get_weather"},
        {"role": "user", "content": "Thanks"},
    ]
    options = body["options"]
    assert (options["num_predict"], options["temperature"], options["top_p"]) == (7, 0.3, 0.8)
    assert options["top_k"] == 5 and options["stop"] == ["END"] and body["think"] is True
    assert body["think_budget"] == 1024  # budget_tokens bounds the thinking


def test_silent_stream_is_kept_alive_with_pings(v1_http, script, monkeypatch):
    monkeypatch.setattr(messages_api, "PING_AFTER", 0.05)
    script([{"content": "a"}, {"content": "b"}, done_event()], pause=0.3)
    body = {"model": "tiny", "max_tokens": 5, "messages": HI, "stream": True}
    r = v1_http.post("/v1/messages", json=body)
    names = [name for name, _ in parse_sse(r.content)]
    assert names[:2] == ["message_start", "ping"]
    # between the first text delta and the next, the stream was silent long enough to ping
    first = names.index("content_block_delta")
    assert "ping" in names[first:]


def test_error_after_the_stream_began_is_an_error_event(claude, script, v1_http):
    script([{"content": "partial"}, {"raise": "the runner fell over"}])
    with (
        pytest.raises(anthropic.APIStatusError, match="the runner fell over"),
        claude.messages.stream(model="tiny", max_tokens=5, messages=HI) as stream,
    ):
        for _ in stream:
            pass
    body = {"model": "tiny", "max_tokens": 5, "messages": HI, "stream": True}
    name, data = parse_sse(v1_http.post("/v1/messages", json=body).content)[-1]
    error = json.loads(data)
    assert name == "error" and error["type"] == "error"
    assert error["error"] == {"type": "api_error", "message": "the runner fell over"}


# -- the real model ---------------------------------------------------------------------


def test_message(claude):
    message = claude.messages.create(
        model="tiny", max_tokens=4, messages=HI, extra_body={"temperature": 0}
    )
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_")
    assert message.model == "tiny" and message.stop_reason in ("end_turn", "max_tokens")
    assert message.content[0].type == "text"
    assert message.usage.input_tokens > 0 and message.usage.output_tokens <= 4


def test_streamed_message_matches_the_whole_one(claude):
    args = {"model": "tiny", "max_tokens": 5, "messages": HI, "extra_body": {"temperature": 0}}
    whole = claude.messages.create(**args)
    with claude.messages.stream(**args) as stream:
        types = [e.type for e in stream]
        streamed = stream.get_final_message()
    assert types[0] == "message_start" and types[-1] == "message_stop"
    assert streamed.content[0].text == whole.content[0].text
    assert streamed.stop_reason == whole.stop_reason
    assert streamed.usage.output_tokens == whole.usage.output_tokens
    # the second reads what the first computed from the prefix cache
    total = streamed.usage.input_tokens + streamed.usage.cache_read_input_tokens
    assert total == whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    assert streamed.usage.cache_read_input_tokens > 0


def test_thinking_blocks_of_a_thinking_model(claude):
    args = {
        "model": "thinker",
        "max_tokens": 4,
        "messages": HI,
        "thinking": {"type": "enabled", "budget_tokens": 1024},
    }
    message = claude.messages.create(**args)
    assert message.content[0].type == "thinking" and message.content[0].thinking
    with claude.messages.stream(**args) as stream:
        streamed = stream.get_final_message()
    assert streamed.content[0].type == "thinking" and streamed.content[0].thinking


def test_forced_tool_use_streams_a_real_call(claude):
    forecast = {
        "name": "get_forecast",
        "input_schema": {
            "type": "object",
            "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["unit"],
            "additionalProperties": False,
        },
    }
    with claude.messages.stream(
        model="tiny",
        max_tokens=1000,
        messages=HI,
        tools=[WEATHER, forecast],
        tool_choice={"type": "tool", "name": "get_forecast"},
        extra_body={"temperature": 0},
    ) as stream:
        deltas = [e for e in stream if e.type == "input_json"]
        message = stream.get_final_message()
    [use] = [b for b in message.content if b.type == "tool_use"]
    assert use.name == "get_forecast" and use.input["unit"] in ("celsius", "fahrenheit")
    assert message.stop_reason == "tool_use" and len(deltas) > 1
    assert all("<tool_call>" not in b.text for b in message.content if b.type == "text")


def test_count_tokens_agrees_with_the_prompt_the_runner_builds(claude):
    system = "You are a weather bot."
    counted = claude.messages.count_tokens(model="tiny", messages=HI, system=system)
    used = claude.messages.create(model="tiny", max_tokens=1, messages=HI, system=system)
    # input_tokens leaves out what was read from the prefix cache, as Anthropic's API does
    assert counted.input_tokens == used.usage.input_tokens + used.usage.cache_read_input_tokens
    assert used.usage.input_tokens > 0
    bare = claude.messages.count_tokens(model="tiny", messages=HI).input_tokens
    with_tools = claude.messages.count_tokens(
        model="tiny", messages=HI, tools=[WEATHER]
    ).input_tokens
    assert bare < counted.input_tokens and bare < with_tools


def test_count_tokens_is_not_cut_to_the_context(claude):
    # far more than the tiny model's 4096-token context: the count is still the whole prompt
    long = [{"role": "user", "content": "weather " * 6000}]
    assert claude.messages.count_tokens(model="tiny", messages=long).input_tokens > 4096


# -- errors -----------------------------------------------------------------------------


def test_error_shape(v1_http):
    r = v1_http.post(
        "/v1/messages",
        json={"model": "nope", "max_tokens": 5, "messages": HI},
        headers={"x-api-key": "k", "anthropic-version": "2023-06-01"},
    )
    body = r.json()
    assert r.status_code == 404 and body["type"] == "error"
    assert body["error"] == {"type": "not_found_error", "message": "model 'nope' not found"}
    assert body["request_id"].startswith("req_")


@pytest.mark.parametrize(
    "body, message",
    [
        ({"model": "tiny", "messages": HI}, "max_tokens: Field required"),
        ({"model": "tiny", "max_tokens": 5, "messages": []}, "at least one message"),
        (
            {"model": "tiny", "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]},
            "invalid role",
        ),
        (
            {"model": "tiny", "max_tokens": 5, "messages": HI, "thinking": {"type": "enabled"}},
            "does not support thinking",
        ),
        (
            {
                "model": "tiny",
                "max_tokens": 5,
                "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
            },
            "does not support image input",
        ),
        (
            {
                "model": "tiny",
                "max_tokens": 5,
                "messages": HI,
                "tools": [{"type": "web_search_20250305", "name": "web_search"}],
            },
            "is not supported",
        ),
    ],
)
def test_bad_requests_are_invalid_request_errors(v1_http, body, message):
    r = v1_http.post("/v1/messages", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and message in error["message"]


def test_sdk_raises_typed_errors(claude):
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="nope", max_tokens=5, messages=HI)
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.count_tokens(model="tiny", messages=[])


def test_tool_input_streams_as_generated(claude, script):
    live = [
        {"tool_call_start": {"index": 0, "name": "get_weather"}},
        {"tool_call_delta": {"index": 0, "arguments": '{"city": '}},
        {"tool_call_delta": {"index": 0, "arguments": '"Oslo"}'}},
        {
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}],
            "streamed": True,
        },
        done_event(),
    ]
    bodies = script(live)
    with claude.messages.stream(
        model="tiny", max_tokens=50, messages=HI, tools=[WEATHER]
    ) as stream:
        deltas = [
            e.delta.partial_json
            for e in stream
            if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
        ]
        final = stream.get_final_message()
    assert bodies[0]["stream_tool_calls"] is True
    assert deltas == ['{"city": ', '"Oslo"}']
    [block] = final.content
    assert (
        block.type == "tool_use" and block.name == "get_weather" and block.input == {"city": "Oslo"}
    )
    assert final.stop_reason == "tool_use"
