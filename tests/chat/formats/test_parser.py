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
