"""The runner protocol's typed request: round trips, and every refusal a runner answers 400."""

from __future__ import annotations

import json

import pytest

from freetoken.protocol import CompletionRequest, Done, ProtocolError


def test_a_request_survives_the_wire():
    req = CompletionRequest(
        kind="generate",
        prompt="hi",
        suffix="!",
        system="s",
        raw=True,
        template="{{ .Prompt }}",
        think="high",
        format={"type": "object"},
        context=[1, 2, 3],
        truncate=False,
        options={"temperature": 0.5, "stop": ["x"]},
        tool_choice={"type": "function", "function": {"name": "f"}},
        logprobs=True,
        top_logprobs=3,
        stream_tool_calls=True,
    )
    assert CompletionRequest.from_json(json.loads(json.dumps(req.to_json()))) == req
    assert CompletionRequest.from_json({}) == CompletionRequest()  # every field has a default


def test_unknown_fields_are_ignored_and_null_means_absent():
    req = CompletionRequest.from_json({"kind": "chat", "prompt": None, "future": 1})
    assert req == CompletionRequest(kind="chat")


@pytest.mark.parametrize(
    "body, message",
    [
        ([], "must be a JSON object"),
        ({"kind": "embed"}, "invalid kind"),
        ({"messages": "hi"}, "'messages'"),
        ({"raw": 1}, "'raw'"),
        ({"top_logprobs": True}, "'top_logprobs'"),
        ({"top_logprobs": 21}, "top_logprobs must be between 0 and 20"),
        ({"context": [1, "2"]}, "context must be a list of token ids"),
        ({"options": {"top_k": "x"}}, 'option "top_k" must be of type integer'),
        ({"options": []}, "'options'"),
        ({"think": "extreme"}, 'invalid think value "extreme"'),
    ],
)
def test_refusals_name_what_is_wrong(body, message):
    with pytest.raises(ProtocolError, match=message):
        CompletionRequest.from_json(body)


def test_options_are_checked_once_and_kept_typed():
    req = CompletionRequest.from_json({"options": {"num_predict": 4.0, "stop": "x", "unknown": 1}})
    assert req.options == {"num_predict": 4, "stop": ["x"]}


def test_logprobs_asked_for_by_either_field():
    assert CompletionRequest().wants_logprobs is None
    assert CompletionRequest(logprobs=True).wants_logprobs == 0
    assert CompletionRequest(top_logprobs=5).wants_logprobs == 5


def test_done_event_on_the_wire():
    done = Done("stop", 3, 10, 2, 20, [1, 2, 3, 4, 5], prompt_cached_count=7)
    assert done.to_json() == {
        "done": True,
        "done_reason": "stop",
        "prompt_eval_count": 3,
        "prompt_eval_duration": 10,
        "eval_count": 2,
        "eval_duration": 20,
        "context": [1, 2, 3, 4, 5],
        "prompt_cached_count": 7,
    }


def test_freetokens_own_fields_travel_only_when_set():
    wire = CompletionRequest(kind="chat", messages=[]).to_json()
    assert wire["tools"] is None and wire["think"] is None  # Ollama's fields: always
    assert not {"tool_choice", "logprobs", "top_logprobs", "images"} & set(wire)
    assert CompletionRequest(tool_choice="none").to_json()["tool_choice"] == "none"
