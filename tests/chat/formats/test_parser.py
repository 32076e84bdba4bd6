"""What the marker-delimited parser does alike for every format."""

from __future__ import annotations

import pytest

from freetoken.chat.formats import (
    DeepSeekFormat,
    GlmFormat,
    HarmonyFormat,
    MiniMaxFormat,
    MistralFormat,
    QwenFormat,
)
from freetoken.chat.formats.parser import OutputParser
from tests.chat.formats.util import options, parse, run

QWEN = QwenFormat()


def test_whitespace_before_thinking_is_no_answer():
    assert parse(QWEN, "\n\n<think>x</think>\n\ny") == [{"thinking": "x"}, {"content": "y"}]
    assert run(lambda: OutputParser(QWEN), " \n ") == [{"content": " \n "}]
    assert parse(QWEN, "\n <think>", tools=True) == []


def test_call_indexes_run_on_across_sections():
    fmt = DeepSeekFormat()
    one = (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}"
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    )
    out = parse(fmt, f"{one} and {one}", stream_calls=True)
    starts = [e["tool_call_start"]["index"] for e in out if "tool_call_start" in e]
    assert starts == [0, 1]
    assert [e for e in out if "content" in e] == [{"content": " and "}]


@pytest.mark.parametrize(
    "fmt, opening",
    [
        (QwenFormat(), '<tool_call>{"name": "get_time", "arguments": {"n": '),
        (DeepSeekFormat(), "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"),
        (GlmFormat(), "<tool_call>get_time\n<arg_key>n</arg_key>\n<arg_value>[1"),
        (MiniMaxFormat(), '<minimax:tool_call><invoke name="get_time"><parameter name="n">'),
        (MistralFormat(), '[TOOL_CALLS][{"name": "get_time", "arguments": {"n": [1'),
        (
            HarmonyFormat(),
            "<|end|><|start|>assistant<|channel|>commentary to=functions.get_time<|message|>{",
        ),
    ],
)
def test_content_before_a_call_is_out_before_the_call_is_complete(fmt, opening):
    prompt = "<|start|>assistant<|channel|>final<|message|>"  # Harmony's: inside a message
    parser = fmt.parser(options(prompt=prompt))
    out = parser.feed("Let me check. ") + parser.feed(opening)
    assert out == [{"content": "Let me check. "}]


@pytest.mark.parametrize(
    "fmt, cut, name, arguments",
    [
        (
            QwenFormat(),
            '<tool_call>{"name": "get_time", "arguments": {"zone": "UT',
            "get_time",
            '{"zone": "UT',
        ),
        (
            QwenFormat(xml=True),
            "<tool_call>\n<function=get_time>\n<parameter=zone>\nUT",
            "get_time",
            "",
        ),
        (
            DeepSeekFormat(),
            '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"zone": ',
            "get_time",
            '{"zone": ',
        ),
        (
            GlmFormat(),
            "<tool_call>get_time\n<arg_key>zone</arg_key>\n<arg_value>UTC</arg_value>\n<arg_key>n",
            "get_time",
            '{"zone": "UTC"',
        ),
        (
            MiniMaxFormat(),
            '<minimax:tool_call><invoke name="get_time"><parameter name="zone">UT',
            "get_time",
            "{",
        ),
        (MistralFormat(), '[TOOL_CALLS]get_time[ARGS]{"zone": "U', "get_time", '{"zone": "U'),
        (
            HarmonyFormat(),
            '<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{"zo',
            "get_time",
            '{"zo',
        ),
    ],
)
def test_a_call_the_limit_cut_is_reported_truncated_never_as_content(fmt, cut, name, arguments):
    out = parse(fmt, "Checking. " + cut if fmt.name != "harmony" else cut, cut=True)
    truncated = [e["tool_call_truncated"] for e in out if "tool_call_truncated" in e]
    assert truncated == [{"index": 0, "name": name, "arguments": arguments}]
    assert not [e for e in out if "content" in e and e["content"] != "Checking. "]
    # not cut (the model stopped there): shown as text, as before
    assert not [e for e in run(lambda: fmt.parser(options()), cut) if "tool_call_truncated" in e]


def test_whole_calls_before_the_cut_one_are_calls():
    text = '[TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x'
    out = parse(MistralFormat(), text, cut=True)
    assert out == [
        {"tool_calls": [{"function": {"name": "a", "arguments": {}}}]},
        {"tool_call_truncated": {"index": 1, "name": "b", "arguments": '{"x'}},
    ]


@pytest.mark.parametrize("fmt", [QWEN, GlmFormat(), MistralFormat()], ids=lambda f: f.name)
def test_a_limit_inside_the_call_marker_is_a_cut_call_not_content(fmt):
    """A forced call the limit cut before its opening marker was whole: the marker's start
    is not shown as text, and the call is reported cut."""
    start = fmt.call_open[: len(fmt.call_open) // 2 + 1]
    out = parse(fmt, "Checking. " + start, cut=True)
    assert [e["content"] for e in out if "content" in e] == ["Checking. "]
    assert [e for e in out if "tool_call_truncated" in e] == [
        {"tool_call_truncated": {"index": 0, "name": "", "arguments": ""}}
    ]
    # a lone first character may end the content: it stays content
    out = parse(fmt, "Checking. " + fmt.call_open[0], cut=True)
    assert not [e for e in out if "tool_call_truncated" in e]
