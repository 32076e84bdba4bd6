"""Streaming output parsing: thinking, tool calls, and no markup ever leaking into content."""

from __future__ import annotations

import json
import random

import pytest

from freetoken.chat.formats.parser import OutputParser
from freetoken.chat.formats.qwen import QwenFormat

QWEN = QwenFormat.from_template(
    "{% if enable_thinking %}<think>{% endif %}<tool_call>{{ tools }}</tool_call>"
)


def run(parser: OutputParser, text: str, seed: int = 0) -> list[dict]:
    """Feeds the text in random pieces (markers split anywhere) and merges adjacent events."""
    rng = random.Random(seed)
    events, i = [], 0
    while i < len(text):
        n = rng.randint(1, 5)
        events += parser.feed(text[i : i + n])
        i += n
    events += parser.finish()
    merged: list[dict] = []
    for e in events:
        if merged and set(e) == set(merged[-1]) and ("content" in e or "thinking" in e):
            key = "content" if "content" in e else "thinking"
            merged[-1] = {key: merged[-1][key] + e[key]}
        else:
            merged.append(e)
    return merged


@pytest.mark.parametrize("seed", range(8))
def test_thinking_then_content(seed):
    out = run(OutputParser(QWEN), "<think>\nLet me see.\n</think>\n\nThe answer is 4.", seed)
    assert out == [{"thinking": "\nLet me see.\n"}, {"content": "The answer is 4."}]


@pytest.mark.parametrize("seed", range(8))
def test_output_that_starts_inside_thinking(seed):
    out = run(OutputParser(QWEN, thinking=True), "hmm</think>ok", seed)
    assert out == [{"thinking": "hmm"}, {"content": "ok"}]


@pytest.mark.parametrize("seed", range(8))
def test_content_then_tool_calls_and_no_markup_leaks(seed):
    text = (
        "Let me check. "
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Tokyo"}}</tool_call>'
        '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    )
    out = run(OutputParser(QWEN, tools=True), text, seed)
    assert out == [
        {"content": "Let me check. "},
        {"tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Tokyo"}}}]},
        {"tool_calls": [{"function": {"name": "now", "arguments": {}}}]},
    ]


def test_xml_function_form_inside_a_tool_call():
    text = (
        "<tool_call><function=search><parameter=query>cats</parameter>"
        "<parameter=n>3</parameter></function></tool_call>"
    )
    assert run(OutputParser(QWEN, tools=True), text) == [
        {"tool_calls": [{"function": {"name": "search", "arguments": {"query": "cats", "n": 3}}}]}
    ]


def test_a_bare_json_answer_is_a_call_when_tools_were_offered():
    text = '  {"name": "add", "arguments": {"a": 1, "b": 2}}'
    assert run(OutputParser(QWEN, tools=True), text) == [
        {"tool_calls": [{"function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]}
    ]
    assert run(OutputParser(QWEN, tools=True), '{"not": "a call"}') == [
        {"content": '{"not": "a call"}'}
    ]
    assert run(OutputParser(QWEN), '{"name": "add", "arguments": {}}') == [
        {"content": '{"name": "add", "arguments": {}}'}
    ]  # no tools offered: just text


def test_a_broken_call_is_shown_not_lost_and_markup_without_tools_is_text():
    assert run(OutputParser(QWEN, tools=True), "<tool_call>{oops</tool_call> after") == [
        {"content": "<tool_call>{oops</tool_call> after"}
    ]
    assert run(OutputParser(QWEN, tools=False), "a <tool_call>x</tool_call>") == [
        {"content": "a <tool_call>x</tool_call>"}
    ]


def test_think_false_drops_thinking_and_a_style_without_markers_passes_text_through():
    assert run(OutputParser(QWEN, show_thinking=False), "<think>x</think>y") == [{"content": "y"}]
    plain = QwenFormat(None, None, None, None)
    assert run(OutputParser(plain, tools=True), "<think>x</think>") == [
        {"content": "<think>x</think>"}
    ]


@pytest.mark.parametrize("seed", range(12))
def test_call_arguments_stream_as_they_are_generated(seed):
    text = (
        'ok <tool_call>{"name": "edit", "arguments": '
        '{"path": "a}b.py", "lines": [1, {"x": "\\"}"}]}}'
        '</tool_call><tool_call>{"name": "now", "arguments": {}}</tool_call>'
    )
    parser = OutputParser(QWEN, tools=True, stream_calls=True)
    rng = random.Random(seed)
    events, i = [], 0
    while i < len(text):
        n = rng.randint(1, 4)
        events += parser.feed(text[i : i + n])
        i += n
    events += parser.finish()
    starts = [e["tool_call_start"] for e in events if "tool_call_start" in e]
    assert starts == [{"index": 0, "name": "edit"}, {"index": 1, "name": "now"}]
    args = {0: "", 1: ""}
    deltas = 0
    for e in events:
        if "tool_call_delta" in e:
            args[e["tool_call_delta"]["index"]] += e["tool_call_delta"]["arguments"]
            deltas += 1
    assert (
        json.loads(args[0]) == {"path": "a}b.py", "lines": [1, {"x": '"}'}]}
        and json.loads(args[1]) == {}
    )
    assert deltas > 3  # the first call's arguments arrived in several pieces
    calls = [e for e in events if "tool_calls" in e]
    assert [c["streamed"] for c in calls] == [True, True]
    assert calls[0]["tool_calls"][0]["function"]["arguments"]["path"] == "a}b.py"
    # the deltas come before the whole call
    assert events.index(calls[0]) > max(
        i for i, e in enumerate(events) if e.get("tool_call_delta", {}).get("index") == 0
    )


def test_without_stream_calls_only_whole_calls_are_emitted():
    out = run(
        OutputParser(QWEN, tools=True),
        '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>',
    )
    assert out == [{"tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]}]


def _streamed_args(events: list[dict]) -> str:
    return "".join(e["tool_call_delta"]["arguments"] for e in events if "tool_call_delta" in e)


@pytest.mark.parametrize("seed", range(12))
def test_a_close_marker_inside_a_string_argument_stays_in_the_argument(seed):
    # a forced call's free string may hold the marker's text, escaped quotes around it too
    args = {"a": "x</tool_call>y", "b": '\\"</tool_call>"'}
    text = (
        f'<tool_call>{{"name": "f", "arguments": {json.dumps(args)}}}</tool_call> ok'
        '<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    )
    out = run(OutputParser(QWEN, tools=True), text, seed)
    assert out == [
        {"tool_calls": [{"function": {"name": "f", "arguments": args}}]},
        {"content": " ok"},
        {"tool_calls": [{"function": {"name": "g", "arguments": {}}}]},
    ]
    parser = OutputParser(QWEN, tools=True, stream_calls=True)
    events = run(parser, text.split(" ok")[0], seed)
    assert json.loads(_streamed_args(events)) == args
    assert events[-1] == {
        "tool_calls": [{"function": {"name": "f", "arguments": args}}],
        "streamed": True,
    }


@pytest.mark.parametrize("seed", range(4))
def test_a_call_whose_string_never_closes_ends_at_its_marker_after_all(seed):
    text = (
        '<tool_call>{"name": "f", "arguments": {"a": "x</tool_call> then '
        '<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    )
    assert run(OutputParser(QWEN, tools=True), text, seed) == [
        {"content": '<tool_call>{"name": "f", "arguments": {"a": "x</tool_call> then '},
        {"tool_calls": [{"function": {"name": "g", "arguments": {}}}]},
    ]


def test_quotes_in_the_xml_form_are_plain_text():
    text = '<tool_call><function=say><parameter=text>a "quote</parameter></function></tool_call>ok'
    assert run(OutputParser(QWEN, tools=True), text) == [
        {"tool_calls": [{"function": {"name": "say", "arguments": {"text": 'a "quote'}}}]},
        {"content": "ok"},
    ]
