"""Streaming output parsing: thinking, tool calls, and no markup ever leaking into content."""

from __future__ import annotations

import random

import pytest

from freetoken.chat.output import OutputParser, Style, style_for

QWEN = style_for("{% if enable_thinking %}<think>{% endif %}<tool_call>{{ tools }}</tool_call>")


def run(parser: OutputParser, text: str, seed: int = 0) -> list[dict]:
    """Feeds the text in random pieces (markers split anywhere) and merges adjacent events."""
    rng = random.Random(seed)
    events, i = [], 0
    while i < len(text):
        n = rng.randint(1, 5)
        events += parser.feed(text[i:i + n])
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
    text = ('Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Tokyo"}}</tool_call>'
            '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')
    out = run(OutputParser(QWEN, tools=True), text, seed)
    assert out == [{"content": "Let me check. "},
                   {"tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Tokyo"}}}]},
                   {"tool_calls": [{"function": {"name": "now", "arguments": {}}}]}]


def test_xml_function_form_inside_a_tool_call():
    text = "<tool_call><function=search><parameter=query>cats</parameter><parameter=n>3</parameter></function></tool_call>"
    assert run(OutputParser(QWEN, tools=True), text) == [
        {"tool_calls": [{"function": {"name": "search", "arguments": {"query": "cats", "n": 3}}}]}]


def test_a_bare_json_answer_is_a_call_when_tools_were_offered():
    text = '  {"name": "add", "arguments": {"a": 1, "b": 2}}'
    assert run(OutputParser(QWEN, tools=True), text) == [
        {"tool_calls": [{"function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]}]
    assert run(OutputParser(QWEN, tools=True), '{"not": "a call"}') == [{"content": '{"not": "a call"}'}]
    assert run(OutputParser(QWEN), '{"name": "add", "arguments": {}}') == [
        {"content": '{"name": "add", "arguments": {}}'}]  # no tools offered: just text


def test_a_broken_call_is_shown_not_lost_and_markup_without_tools_is_text():
    assert run(OutputParser(QWEN, tools=True), "<tool_call>{oops</tool_call> after") == [
        {"content": "<tool_call>{oops</tool_call> after"}]
    assert run(OutputParser(QWEN, tools=False), "a <tool_call>x</tool_call>") == [
        {"content": "a <tool_call>x</tool_call>"}]


def test_think_false_drops_thinking_and_a_style_without_markers_passes_text_through():
    assert run(OutputParser(QWEN, show_thinking=False), "<think>x</think>y") == [{"content": "y"}]
    plain = Style(None, None, None, None)
    assert run(OutputParser(plain, tools=True), "<think>x</think>") == [{"content": "<think>x</think>"}]
