"""OpenAI Responses (stateless) with the real `openai` SDK, against the real server."""

import json

import openai
import pytest

from freetoken.api.responses_stream import Meta, ResponseStream

from .conftest import SCRIPT, done_event, events_of, parse_sse, render

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


@pytest.fixture
def oai(v1_server):
    return openai.OpenAI(base_url=v1_server.url + "/v1", api_key="ollama", max_retries=0)


# -- the stream builder, fed scripted events --------------------------------------------


def test_event_sequence_of_a_streamed_response():
    frames = parse_sse(render(ResponseStream(Meta(model="m")).frames(events_of(SCRIPT))))
    data = [json.loads(d) for _, d in frames]
    assert all(name == d["type"] for (name, _), d in zip(frames, data))
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    added = [d["item"]["type"] for d in data if d["type"] == "response.output_item.added"]
    assert added == ["reasoning", "message", "function_call", "function_call"]
    done = [d for d in data if d["type"] == "response.output_item.done"]
    assert [d["output_index"] for d in done] == [0, 1, 2, 3]
    pieces = [
        d["delta"]
        for d in data
        if d["type"] == "response.function_call_arguments.delta" and d["output_index"] == 2
    ]
    assert len(pieces) > 1 and "".join(pieces) == '{"city":"Tōkyō","unit":"c"}'
    assert data[0]["type"] == "response.created" and data[1]["type"] == "response.in_progress"
    final = data[-1]
    assert final["type"] == "response.completed"
    assert final["response"]["status"] == "completed"
    assert [o["type"] for o in final["response"]["output"]] == added
    assert final["response"]["usage"]["total_tokens"] == 12


def test_an_answer_cut_by_the_limit_is_incomplete():
    frames = parse_sse(
        render(ResponseStream(Meta(model="m")).frames(events_of([done_event("length")])))
    )
    final = json.loads(frames[-1][1])["response"]
    assert final["status"] == "incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    # an empty answer is still one (empty) message
    assert [o["type"] for o in final["output"]] == ["message"]


# -- scripted runner events through the real server --------------------------------------


def test_sdk_stream_helper_assembles_scripted_calls(oai, script):
    bodies = script(SCRIPT)
    with oai.responses.stream(
        model="tiny",
        input="Weather in Tokyo?",
        instructions="Be brief.",
        tools=[WEATHER],
        tool_choice="required",
    ) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    reasoning, message, weather, clock = final.output
    assert (
        reasoning.type == "reasoning" and reasoning.summary[0].text == "The user wants the weather."
    )
    assert message.type == "message" and final.output_text == "Let me check."
    assert weather.type == "function_call" and weather.name == "get_weather"
    assert json.loads(weather.arguments) == {"city": "Tōkyō", "unit": "c"}
    assert clock.arguments == '{"zone":"Asia/Tokyo","n":[1,2]}'
    assert weather.call_id.startswith("call_") and weather.call_id != clock.call_id
    [body] = bodies
    assert body["messages"][:2] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Tokyo?"},
    ]
    assert body["tool_choice"] == "required"
    assert body["tools"] == [
        {
            "type": "function",
            "function": {k: WEATHER[k] for k in ("name", "description", "parameters")},
        }
    ]


def test_non_streamed_calls(oai, script):
    script(SCRIPT)
    out = oai.responses.create(model="tiny", input="Weather?", tools=[WEATHER])
    assert out.status == "completed" and out.object == "response" and out.id.startswith("resp_")
    assert [o.type for o in out.output] == [
        "reasoning",
        "message",
        "function_call",
        "function_call",
    ]
    assert out.output[2].arguments == '{"city":"Tōkyō","unit":"c"}'
    assert out.usage.input_tokens == 7 and out.usage.output_tokens == 5


def test_input_items_translation(oai, script):
    bodies = script([done_event()])
    oai.responses.create(
        model="thinker",
        reasoning={"effort": "minimal"},
        max_output_tokens=6,
        text={"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}},
        tool_choice={"type": "function", "name": "get_weather"},
        tools=[WEATHER],
        input=[
            {"role": "developer", "content": "Use tools."},
            {"role": "user", "content": [{"type": "input_text", "text": "Weather in Tokyo?"}]},
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [{"type": "summary_text", "text": "Look it up."}],
            },
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": '{"city":"Tokyo"}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "22C"},
        ],
    )
    [body] = bodies
    call = {"index": 0, "name": "get_weather", "arguments": {"city": "Tokyo"}}
    assert body["messages"] == [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Tokyo?"},
        {
            "role": "assistant",
            "content": "",
            "thinking": "Look it up.",
            "tool_calls": [{"id": "call_1", "function": call}],
        },
        {"role": "tool", "content": "22C", "tool_call_id": "call_1", "tool_name": "get_weather"},
    ]
    assert body["think"] == "low" and body["options"]["num_predict"] == 6
    assert body["format"] == {"type": "object"}
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}


def test_error_after_the_stream_began_is_response_failed(oai, script):
    script([{"content": "partial"}, {"raise": "the runner fell over"}])
    stream = oai.responses.create(model="tiny", input="hi", stream=True)
    kinds = [e for e in stream]
    assert kinds[-1].type == "response.failed"
    assert kinds[-1].response.status == "failed"
    assert kinds[-1].response.error.message == "the runner fell over"


# -- the real model ---------------------------------------------------------------------


def test_response(oai):
    out = oai.responses.create(model="tiny", input="Why is the sky blue?", max_output_tokens=4)
    assert out.status in ("completed", "incomplete") and out.model == "tiny"
    assert out.output[-1].type == "message" and isinstance(out.output_text, str)
    assert out.usage.input_tokens > 0 and out.usage.output_tokens <= 4


def test_streamed_response_matches_the_whole_one(oai):
    args = {
        "model": "tiny",
        "input": "Why is the sky blue?",
        "max_output_tokens": 5,
        "temperature": 0,
    }
    whole = oai.responses.create(**args)
    with oai.responses.stream(**args) as stream:
        final = stream.get_final_response()
    assert final.output_text == whole.output_text and final.status == whole.status


def test_reasoning_summary_of_a_thinking_model(oai):
    out = oai.responses.create(model="thinker", input="Why?", max_output_tokens=4)
    assert out.output[0].type == "reasoning" and out.output[0].summary[0].text


def test_required_tool_choice_gives_a_real_function_call(oai):
    forecast = {
        "type": "function",
        "name": "get_forecast",
        "parameters": {
            "type": "object",
            "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["unit"],
            "additionalProperties": False,
        },
    }
    with oai.responses.stream(
        model="tiny",
        input="Weather?",
        tools=[forecast],
        tool_choice="required",
        temperature=0,
        max_output_tokens=1000,
    ) as stream:
        deltas = [e for e in stream if e.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    [call] = [o for o in final.output if o.type == "function_call"]
    assert call.name == "get_forecast"
    assert json.loads(call.arguments)["unit"] in ("celsius", "fahrenheit")
    assert len(deltas) > 1 and final.status == "completed"


@pytest.mark.parametrize(
    "body, message",
    [
        (
            {"model": "tiny", "input": "hi", "previous_response_id": "resp_1"},
            "previous_response_id",
        ),
        ({"model": "tiny", "input": [{"type": "computer_call"}]}, "is not supported"),
        ({"model": "tiny", "input": "hi", "tools": [{"type": "web_search"}]}, "is not supported"),
        ({"model": "nope", "input": "hi"}, "model 'nope' not found"),
    ],
)
def test_bad_requests(oai, body, message):
    with pytest.raises(openai.APIStatusError, match=message):
        oai.responses.create(**body)
