"""Granite's `<|tool_call|>`: a JSON list of calls after the marker."""

from __future__ import annotations

from freetoken.chat import formats
from freetoken.chat.formats.granite import GraniteFormat
from tests.chat.formats.util import accepts, calls, forced, parse

GRANITE = GraniteFormat()
# the tool-call turn of granite-3.x's chat template
TEMPLATE = "<|start_of_role|>assistant<|end_of_role|><|tool_call|>{{ message['content'] }}"


def test_content_then_a_list_of_calls_in_either_key_order():
    text = (
        'Let me check.<|tool_call|>[{"arguments": {"city": "Paris", "days": 3}, "name": '
        '"get_weather"}, {"name": "get_time", "arguments": {"zone": "CET"}}]'
    )
    out = parse(GRANITE, text)
    assert out[0] == {"content": "Let me check."}
    assert calls(out) == [
        {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}},
        {"name": "get_time", "arguments": {"zone": "CET"}},
    ]


def test_a_broken_call_is_shown_without_its_marker():
    assert parse(GRANITE, '<|tool_call|>[{"nom": 1}]') == [{"content": '[{"nom": 1}]'}]


def test_the_architecture_and_the_template_both_name_it():
    assert type(formats.format_for("granitemoe", None)) is GraniteFormat
    assert type(formats.format_for("some_new_family", TEMPLATE)) is GraniteFormat
    assert "<|tool_call|>" in formats.MARKERS


def test_forced_calls_are_a_list_after_the_marker():
    good = '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    grammar = forced(GRANITE, "get_weather")
    assert accepts(grammar, good) and calls(parse(GRANITE, good))
    assert not accepts(grammar, '[TOOL_CALLS][{"name": "get_weather", "arguments": {}}]')
