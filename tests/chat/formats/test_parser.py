"""What the marker-delimited parser does alike for every format."""

from __future__ import annotations

from freetoken.chat.formats import DeepSeekFormat, QwenFormat
from freetoken.chat.formats.parser import OutputParser
from tests.chat.formats.util import parse, run

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
