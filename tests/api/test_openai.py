"""The OpenAI-compatible routes with the real `openai` SDK, against the real server.

The tiny random model never calls a tool by itself, so tool calls are tested with scripted
runner events (the `script` fixture, or a stream builder fed an event list) and read back
by the SDK's own parser and accumulator; everything else runs on the real model.
"""

import json

import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from freetoken.api.openai_stream import ChatStream, CompletionStream

from .conftest import SCRIPT, done_event, events_of, parse_sse, render

HI = [{"role": "user", "content": "Why is the sky blue?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}
# The arguments of SCRIPT's calls, as the wire must carry them.
ARGUMENTS = ['{"city":"Tōkyō","unit":"c"}', '{"zone":"Asia/Tokyo","n":[1,2]}']


def _chunks(raw: bytes) -> list[ChatCompletionChunk]:
    frames = parse_sse(raw)
    assert frames[-1] == (None, "[DONE]")
    assert all(name is None for name, _ in frames)
    return [ChatCompletionChunk.model_validate(json.loads(data)) for _, data in frames[:-1]]


# -- the stream builder, fed scripted events --------------------------------------------


def test_streamed_tool_calls_reassemble_exactly_in_the_sdk():
    chunks = _chunks(render(ChatStream("m", include_usage=True).frames(events_of(SCRIPT))))
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(chunk)
    final = state.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    calls = choice.message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert [c.function.arguments for c in calls] == ARGUMENTS
    assert all(c.id.startswith("call_") and len(c.id) == 13 for c in calls)
    assert len({c.id for c in calls}) == 2
    # each call: one chunk with its id and name, then its arguments in several pieces
    for index in (0, 1):
        deltas = [
            d
            for c in chunks
            for ch in c.choices
            for d in ch.delta.tool_calls or []
            if d.index == index
        ]
        assert deltas[0].id and deltas[0].function.name and deltas[0].function.arguments == ""
        assert all(d.id is None and d.function.name is None for d in deltas[1:])
        assert len(deltas) > 2


def test_stream_shape_role_reasoning_finish_usage_done():
    chunks = _chunks(render(ChatStream("m", include_usage=True).frames(events_of(SCRIPT))))
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    assert all(c.object == "chat.completion.chunk" and c.model == "m" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(ch.delta.role is None for c in chunks[1:] for ch in c.choices)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning", "") for d in deltas) == (
        "The user wants the weather."
    )
    assert "<tool_call>" not in "".join(d.content or "" for d in deltas)
    *_, finish, usage = chunks
    assert finish.choices[0].finish_reason == "tool_calls"
    assert finish.choices[0].delta.model_dump(exclude_none=True) == {}
    assert usage.choices == [] and usage.usage.model_dump(exclude_none=True) == {
        "prompt_tokens": 7,
        "completion_tokens": 5,
        "total_tokens": 12,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_stream_without_usage_and_an_empty_answer():
    chunks = _chunks(render(ChatStream("m").frames(events_of([done_event("length")]))))
    assert len(chunks) == 2
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)


def test_completion_stream_builder_drops_thinking():
    events = [{"thinking": "hm"}, {"content": "ab"}, {"content": "c"}, done_event()]
    frames = parse_sse(render(CompletionStream("m", include_usage=True).frames(events_of(events))))
    objects = [json.loads(d) for _, d in frames[:-1]]
    assert [c["text"] for o in objects for c in o["choices"]] == ["ab", "c", ""]
    assert objects[-2]["choices"][0]["finish_reason"] == "stop"
    assert objects[-1]["choices"] == [] and objects[-1]["usage"]["total_tokens"] == 12
    assert all(o["object"] == "text_completion" for o in objects)


# -- scripted runner events through the real server --------------------------------------


def test_sdk_stream_helper_assembles_scripted_tool_calls(oai, script):
    bodies = script(SCRIPT)
    with oai.chat.completions.stream(
        model="tiny", messages=HI, tools=[WEATHER, CLOCK], tool_choice="required"
    ) as stream:
        final = stream.get_final_completion()
    message = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls"
    assert [c.function.arguments for c in message.tool_calls] == ARGUMENTS
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Tōkyō", "unit": "c"}
    assert message.content == "Let me check."
    [body] = bodies
    assert body["tool_choice"] == "required" and body["tools"] == [WEATHER, CLOCK]


def test_non_streamed_tool_calls_and_reasoning(oai, script):
    script(SCRIPT)
    out = oai.chat.completions.create(model="tiny", messages=HI, tools=[WEATHER, CLOCK])
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [c.function.arguments for c in choice.message.tool_calls] == ARGUMENTS
    assert [c.type for c in choice.message.tool_calls] == ["function", "function"]
    assert choice.message.model_extra["reasoning"] == "The user wants the weather."
    assert out.usage.total_tokens == 12


def test_tool_choice_none_offers_no_tools(oai, script):
    bodies = script([done_event()])
    oai.chat.completions.create(model="tiny", messages=HI, tools=[WEATHER], tool_choice="none")
    assert bodies[0]["tools"] is None and "tool_choice" not in bodies[0]


# A tool-using turn in OpenAI's shape, and as the runner must receive it.
OPENAI_TURN = [
    {"role": "developer", "content": "Be brief."},
    {
        "role": "user",
        "content": [{"type": "text", "text": "Weather"}, {"type": "text", "text": "in Tokyo?"}],
    },
    {
        "role": "assistant",
        "content": None,
        "reasoning": "I should look it up.",
        "tool_calls": [
            {
                "id": "call_a1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Tokyo"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_a1", "content": "22C"},
]

OLLAMA_TURN = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather\n\nin Tokyo?"},
    {
        "role": "assistant",
        "content": "",
        "thinking": "I should look it up.",
        "tool_calls": [
            {
                "id": "call_a1",
                "function": {"index": 0, "name": "get_weather", "arguments": {"city": "Tokyo"}},
            }
        ],
    },
    {"role": "tool", "content": "22C", "tool_call_id": "call_a1", "tool_name": "get_weather"},
]


def test_request_translation(oai, script):
    bodies = script([done_event()])
    oai.chat.completions.create(
        model="tiny",
        messages=OPENAI_TURN,
        max_tokens=3,
        max_completion_tokens=9,
        stop="END",
        seed=42,
        frequency_penalty=0.5,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "w", "schema": {"type": "object"}},
        },
        reasoning_effort="none",
        logprobs=True,
        top_logprobs=2,
    )
    [body] = bodies
    assert body["messages"] == OLLAMA_TURN
    options = body["options"]
    assert options["num_predict"] == 9 and options["stop"] == ["END"] and options["seed"] == 42
    assert options["temperature"] == 1.0 and options["top_p"] == 1.0
    assert options["frequency_penalty"] == 0.5
    assert body["format"] == {"type": "object"} and body["think"] is False
    assert body["logprobs"] is True and body["top_logprobs"] == 2


@pytest.mark.parametrize(
    "effort, think", [("minimal", "low"), ("low", "low"), ("high", "high"), ("xhigh", "high")]
)
def test_reasoning_effort_maps_to_think(oai, script, effort, think):
    bodies = script([done_event()])
    oai.chat.completions.create(model="thinker", messages=HI, reasoning_effort=effort)
    oai.chat.completions.create(
        model="thinker", messages=HI, extra_body={"reasoning": {"effort": effort}}
    )
    assert [b["think"] for b in bodies] == [think, think]
    # a level's budget (FREETOKEN_THINK_BUDGETS, by default) bounds the thinking
    budget = {"low": 1024, "medium": 4096, "high": 16384}.get(think)
    assert [b.get("think_budget") for b in bodies] == [budget, budget]


def test_json_object_format_and_sampling_defaults_left_to_the_request(oai, script):
    bodies = script([done_event()])
    oai.chat.completions.create(
        model="tiny",
        messages=HI,
        response_format={"type": "json_object"},
        temperature=0.2,
        top_p=0.5,
    )
    assert bodies[0]["format"] == "json"
    assert bodies[0]["options"]["temperature"] == 0.2 and bodies[0]["options"]["top_p"] == 0.5


def test_error_after_the_stream_began_is_an_error_event(oai, script, v1_http):
    script([{"content": "partial"}, {"raise": "the runner fell over"}])
    stream = oai.chat.completions.create(model="tiny", messages=HI, stream=True)
    with pytest.raises(openai.APIError, match="the runner fell over"):
        for _ in stream:
            pass
    r = v1_http.post("/v1/chat/completions", json={"model": "tiny", "messages": HI, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    frames = parse_sse(r.content)
    assert json.loads(frames[-1][1]) == {
        "error": {
            "message": "the runner fell over",
            "type": "api_error",
            "param": None,
            "code": None,
        }
    }
    assert (None, "[DONE]") not in frames


def test_error_before_the_stream_began_keeps_its_status(oai, script):
    script([{"raise": "could not load"}])
    with pytest.raises(openai.InternalServerError) as e:
        list(oai.chat.completions.create(model="tiny", messages=HI, stream=True))
    assert e.value.status_code == 500 and e.value.body["type"] == "api_error"


# -- the real model ---------------------------------------------------------------------


def test_chat_completion(oai):
    out = oai.chat.completions.create(model="tiny", messages=HI, max_tokens=4, temperature=0)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert out.model == "tiny" and out.system_fingerprint
    choice = out.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    usage = out.usage
    assert usage.prompt_tokens > 0 and 0 <= usage.completion_tokens <= 4
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_chat_stream_matches_the_whole_answer(oai):
    args = {"model": "tiny", "messages": HI, "max_completion_tokens": 5, "temperature": 0}
    whole = oai.chat.completions.create(**args)
    chunks = list(
        oai.chat.completions.create(**args, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    *_, finish, usage = chunks
    assert finish.choices[0].finish_reason == whole.choices[0].finish_reason
    assert usage.choices == [] and usage.usage.completion_tokens == whole.usage.completion_tokens


def test_a_repeated_prompt_reports_its_cached_tokens(oai):
    """OpenAI counts every prompt token and the cached ones apart; a follow-up turn reads the
    conversation so far from the prefix cache."""
    args = {"model": "tiny", "max_completion_tokens": 6, "temperature": 0}
    first = oai.chat.completions.create(messages=HI, **args)
    answer = {"role": "assistant", "content": first.choices[0].message.content or "."}
    turn = [*HI, answer, {"role": "user", "content": "And at sunset?"}]
    second = oai.chat.completions.create(messages=turn, **args)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens
    assert cached >= first.usage.prompt_tokens // 16 * 16 - 16


def test_reasoning_of_a_thinking_model(oai):
    out = oai.chat.completions.create(model="thinker", messages=HI, max_tokens=4)
    assert out.choices[0].message.model_extra.get("reasoning")
    chunks = list(
        oai.chat.completions.create(model="thinker", messages=HI, max_tokens=4, stream=True)
    )
    assert any((c.choices[0].delta.model_extra or {}).get("reasoning") for c in chunks if c.choices)
    hidden = oai.chat.completions.create(
        model="thinker", messages=HI, max_tokens=4, reasoning_effort="none"
    )
    assert not hidden.choices[0].message.model_extra.get("reasoning")


def test_tools_with_a_real_model(oai):
    out = oai.chat.completions.create(model="tiny", messages=HI, tools=[WEATHER], max_tokens=3)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")


# A tool whose only argument is an enum: constrained decoding of the random model ends fast.
FORECAST = {
    "type": "function",
    "function": {
        "name": "get_forecast",
        "parameters": {
            "type": "object",
            "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["unit"],
            "additionalProperties": False,
        },
    },
}


def test_required_tool_choice_streams_a_real_call(oai):
    # tool_choice "required" sends the real model down the tool-call grammar
    with oai.chat.completions.stream(
        model="tiny",
        messages=HI,
        tools=[WEATHER, FORECAST],
        tool_choice={"type": "function", "function": {"name": "get_forecast"}},
        temperature=0,
        max_tokens=1000,
    ) as stream:
        chunks = [e.chunk for e in stream if e.type == "chunk"]
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_forecast" and call.id.startswith("call_")
    assert json.loads(call.function.arguments)["unit"] in ("celsius", "fahrenheit")
    assert "<tool_call>" not in (choice.message.content or "")
    pieces = [d for c in chunks for ch in c.choices for d in ch.delta.tool_calls or []]
    assert len(pieces) > 2
    whole = oai.chat.completions.create(
        model="tiny",
        messages=HI,
        tools=[FORECAST],
        tool_choice="required",
        temperature=0,
        max_tokens=1000,
    )
    assert whole.choices[0].finish_reason == "tool_calls"
    assert whole.choices[0].message.tool_calls[0].function.name == "get_forecast"


def test_json_schema_response_format(oai):
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    out = oai.chat.completions.create(
        model="tiny",
        messages=HI,
        response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}},
        temperature=0,
        max_tokens=1000,
    )
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].message.content)["ok"], bool)


def test_logprobs(oai):
    args = {"model": "tiny", "messages": HI, "max_tokens": 4, "logprobs": True, "top_logprobs": 2}
    out = oai.chat.completions.create(**args)
    entries = out.choices[0].logprobs.content
    assert len(entries) == out.usage.completion_tokens
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in entries)
    chunks = list(
        oai.chat.completions.create(**args, stream=True, stream_options={"include_usage": True})
    )
    streamed = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert len(streamed) == chunks[-1].usage.completion_tokens
    text = oai.completions.create(model="tiny", prompt="Once", max_tokens=3, logprobs=2)
    lp = text.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert lp.text_offset[0] == 0 and all(len(t) <= 2 for t in lp.top_logprobs)


def test_completions(oai):
    out = oai.completions.create(model="tiny", prompt="Once upon", max_tokens=3, temperature=0)
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert out.choices[0].finish_reason in ("stop", "length") and out.usage.completion_tokens <= 3
    chunks = list(
        oai.completions.create(
            model="tiny",
            prompt="Once upon",
            max_tokens=3,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == out.choices[0].text
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens


def test_completions_with_a_suffix_needs_insert(oai):
    with pytest.raises(openai.BadRequestError, match="does not support insert"):
        oai.completions.create(model="tiny", prompt="def f(", suffix="return 1", max_tokens=2)


def test_models_list_and_retrieve(oai):
    models = {m.id: m for m in oai.models.list()}
    assert {"tiny:latest", "thinker:latest", "endless:latest", "team/tiny:v1"} <= set(models)
    assert models["tiny:latest"].owned_by == "library" and models["tiny:latest"].object == "model"
    assert models["team/tiny:v1"].owned_by == "team" and models["team/tiny:v1"].created > 0
    assert oai.models.retrieve("team/tiny:v1").owned_by == "team"
    assert oai.models.retrieve("tiny").id == "tiny:latest"
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("nope")


def test_empty_model_list_is_an_empty_array(tmp_path):
    from tests.server.harness import local_client, make_config

    with local_client(make_config(tmp_path)) as c:
        assert c.get("/v1/models").json() == {"object": "list", "data": []}


# Arguments as the runner streams them while the model writes them (stream_tool_calls).
LIVE = [
    {"content": "Checking. "},
    {"tool_call_start": {"index": 0, "name": "get_weather"}},
    {"tool_call_delta": {"index": 0, "arguments": '{"city": '}},
    {"tool_call_delta": {"index": 0, "arguments": '"Tōkyō", '}},
    {"tool_call_delta": {"index": 0, "arguments": '"unit": "c"}'}},
    {
        "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"city": "Tōkyō", "unit": "c"}}}
        ],
        "streamed": True,
    },
    done_event(),
]


def test_arguments_stream_as_generated_and_are_not_sent_twice(oai, script):
    bodies = script(LIVE)
    with oai.chat.completions.stream(model="tiny", messages=HI, tools=[WEATHER]) as stream:
        chunks = [e.chunk for e in stream if e.type == "chunk"]
        final = stream.get_final_completion()
    assert bodies[0]["stream_tool_calls"] is True
    pieces = [
        d.function.arguments for c in chunks for ch in c.choices for d in ch.delta.tool_calls or []
    ]
    assert pieces == [
        "",
        '{"city": ',
        '"Tōkyō", ',
        '"unit": "c"}',
    ]  # the head, then each delta once
    [call] = final.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Tōkyō", "unit": "c"}
    assert final.choices[0].finish_reason == "tool_calls"
    not_streamed = script(LIVE)
    oai.chat.completions.create(model="tiny", messages=HI, tools=[WEATHER])
    assert not_streamed[0]["stream_tool_calls"] is False
