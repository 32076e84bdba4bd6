"""Mistral's `[TOOL_CALLS]`: a JSON list of calls, or NAME[ARGS]{...} per call."""

from __future__ import annotations

import pytest

from freetoken.chat.formats.mistral import MistralFormat
from tests.chat.formats.util import accepts, calls, forced, parse, streamed_arguments

LISTED = MistralFormat()
NAMED = MistralFormat(listed=False)
WANT = [
    {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}},
    {"name": "get_time", "arguments": {"zone": "[ARGS]", "n": [1, 2]}},
]


def test_content_then_a_list_of_calls():
    text = (
        'Checking.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", '
        '"days": 3}}, {"name": "get_time", "arguments": "{\\"zone\\": \\"[ARGS]\\", '
        '\\"n\\": [1, 2]}"}]'
    )
    assert parse(LISTED, text) == [
        {"content": "Checking."},
        {"tool_calls": [{"function": WANT[0]}]},
        {"tool_calls": [{"function": WANT[1]}]},
    ]


def test_named_calls_one_per_marker_with_call_ids_and_streamed_arguments():
    text = (
        'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}'
        '[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{"zone": "[ARGS]", "n": [1, 2]} ok'
    )
    out = parse(NAMED, text, stream_calls=True)
    assert calls(out) == WANT
    assert out[0] == {"content": "Checking."} and out[-1] == {"content": " ok"}
    assert streamed_arguments(out) == {0: WANT[0]["arguments"], 1: WANT[1]["arguments"]}
    starts = [e["tool_call_start"]["name"] for e in out if "tool_call_start" in e]
    assert starts == ["get_weather", "get_time"]


@pytest.mark.parametrize(
    "text, shown",
    [
        (
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Pa',
            '[{"name": "get_weather", "arguments": {"city": "Pa',
        ),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": ', 'get_weather{"city":'),
        ('[TOOL_CALLS][{"nom": 1}]', '[{"nom": 1}]'),
        ("[TOOL_CALLS]get_weather[ARGS][1]", "get_weather[1]"),
    ],
)
def test_broken_and_cut_calls_are_shown_without_markup(text, shown):
    assert parse(LISTED, text) == [{"content": shown}]


def test_an_empty_list_is_no_call():
    assert parse(LISTED, "[TOOL_CALLS][]") == []


def test_forced_calls_follow_the_templates_form():
    assert MistralFormat.from_template("{{ '[TOOL_CALLS]' + name + '[ARGS]' }}") == NAMED
    assert MistralFormat.from_template("[TOOL_CALLS]") == LISTED
    listed = forced(LISTED)
    good = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    assert accepts(listed, good) and calls(parse(LISTED, good))
    named = forced(NAMED, "get_weather")
    assert accepts(named, '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}')
    assert not accepts(named, "[TOOL_CALLS]get_time[ARGS]{}")
    assert accepts(forced(NAMED), "[TOOL_CALLS]get_time[ARGS]{}")
