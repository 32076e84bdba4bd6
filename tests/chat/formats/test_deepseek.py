"""DeepSeek's thinking and tool-call markers, in V3's form and V3.1's."""

from __future__ import annotations

import pytest

from freetoken.chat.formats.deepseek import (
    CALL_BEGIN,
    CALL_END,
    CALLS_BEGIN,
    CALLS_END,
    SEP,
    DeepSeekFormat,
)
from tests.chat.formats.util import (
    accepts,
    calls,
    forced,
    options,
    parse,
    run,
    streamed_arguments,
)

V3 = DeepSeekFormat(fenced=True)
V31 = DeepSeekFormat()


def v3_call(name: str, args: str) -> str:
    return f"{CALL_BEGIN}function{SEP}{name}\n```json\n{args}\n```{CALL_END}"


def v31_call(name: str, args: str) -> str:
    return f"{CALL_BEGIN}{name}{SEP}{args}{CALL_END}"


PARIS, TOKYO = '{"city": "Paris", "days": 3}', '{"zone": "Asia/Tokyo", "n": [1, 2]}'
WANT = [
    {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}},
    {"name": "get_time", "arguments": {"zone": "Asia/Tokyo", "n": [1, 2]}},
]


@pytest.mark.parametrize("call", [v3_call, v31_call])
def test_thinking_content_then_parallel_calls(call):
    text = (
        "<think>Two cities.</think>\n\nLet me check."
        f"{CALLS_BEGIN}{call('get_weather', PARIS)}\n{call('get_time', TOKYO)}{CALLS_END}"
    )
    out = parse(V31, text)
    assert out == [
        {"thinking": "Two cities."},
        {"content": "Let me check."},
        {"tool_calls": [{"function": WANT[0]}]},
        {"tool_calls": [{"function": WANT[1]}]},
    ]


def test_a_prompt_that_opened_thinking_and_content_after_the_calls():
    text = f"hmm</think>ok{CALLS_BEGIN}{v31_call('get_time', '{}')}{CALLS_END} done"
    out = parse(V3, text, prompt="<｜User｜>hi<｜Assistant｜><think>\n")
    assert out == [
        {"thinking": "hmm"},
        {"content": "ok"},
        {"tool_calls": [{"function": {"name": "get_time", "arguments": {}}}]},
        {"content": " done"},
    ]


@pytest.mark.parametrize("call", [v3_call, v31_call])
def test_arguments_stream_in_both_forms(call):
    args = '{"city": "a}b", "days": 2}'
    text = f"{CALLS_BEGIN}{call('get_weather', args)}{call('get_time', '{}')}{CALLS_END}"
    out = parse(V31, text, stream_calls=True)
    starts = [e["tool_call_start"] for e in out if "tool_call_start" in e]
    assert starts == [{"index": 0, "name": "get_weather"}, {"index": 1, "name": "get_time"}]
    assert streamed_arguments(out) == {0: {"city": "a}b", "days": 2}, 1: {}}
    assert [e.get("streamed") for e in out if "tool_calls" in e] == [True, True]
    # one character at a time, the arguments arrive in many pieces
    pieces = run(lambda: V31.parser(options(stream_calls=True)), text, seed=-1)
    assert len([e for e in pieces if "tool_call_delta" in e]) == 2  # merged per call
    assert calls(pieces) == calls(out)


def test_an_end_marker_inside_a_string_argument_stays_in_it():
    args = '{"city": "x' + CALL_END + CALLS_END + '"}'
    text = f"{CALLS_BEGIN}{v31_call('get_weather', args)}{CALLS_END}after"
    out = parse(V31, text)
    assert calls(out) == [
        {"name": "get_weather", "arguments": {"city": "x" + CALL_END + CALLS_END}}
    ]
    assert out[-1] == {"content": "after"}


def test_broken_and_cut_calls_are_shown_without_markup():
    bad = f"{CALLS_BEGIN}{v31_call('get_weather', '{oops')}{CALLS_END}next"
    assert parse(V31, bad) == [{"content": "get_weather{oopsnext"}]
    cut = f"ok{CALLS_BEGIN}{CALL_BEGIN}get_weather{SEP}" + '{"city": "Pa'
    assert parse(V31, cut) == [{"content": 'okget_weather{"city": "Pa'}]
    # a string never closed hid the call's end: it ended there after all
    hidden = (
        f'{CALLS_BEGIN}{CALL_BEGIN}get_time{SEP}{{"zone": "x{CALL_END}{v31_call("get_time", "{}")}'
    )
    assert calls(parse(V31, hidden)) == [{"name": "get_time", "arguments": {}}]
    # the section's end without the call's
    short = f"{CALLS_BEGIN}{CALL_BEGIN}get_time{SEP}{{}}{CALLS_END}"
    assert calls(parse(V31, short)) == [{"name": "get_time", "arguments": {}}]


def test_without_tools_markup_is_text_and_think_false_drops_thinking():
    text = f"<think>x</think>y{CALLS_BEGIN}"
    assert run(lambda: V31.parser(options(tools=False)), text) == [
        {"thinking": "x"},
        {"content": "y" + CALLS_BEGIN},
    ]
    assert parse(V31, "<think>x</think>y", show_thinking=False) == [{"content": "y"}]


@pytest.mark.parametrize("fmt, call", [(V3, v3_call), (V31, v31_call)])
def test_forced_calls_follow_the_templates_form(fmt, call):
    grammar = forced(fmt)
    one = f"{CALLS_BEGIN}{call('get_weather', PARIS)}{CALLS_END}"
    assert accepts(grammar, one)
    assert accepts(grammar, f"{CALLS_BEGIN}{call('get_time', TOKYO)}{CALLS_END}")
    assert not accepts(grammar, f"{CALLS_BEGIN}{call('get_weather', '{}')}{CALLS_END}")
    assert not accepts(forced(fmt, "get_time"), one)
    assert calls(parse(fmt, one)) == WANT[:1]


def test_the_template_says_which_form_and_thinking_reaches_it():
    assert DeepSeekFormat.from_template("... '```json' ...") == V3
    assert DeepSeekFormat.from_template(None) == V31
    assert V31.template_variables("high") == {
        "enable_thinking": True,
        "reasoning_effort": "high",
        "thinking": True,
    }
    assert V31.template_variables(None) == {}
