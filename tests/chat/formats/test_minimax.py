"""MiniMax-M2's `<minimax:tool_call>` sections of `<invoke>`s."""

from __future__ import annotations

from freetoken.chat.formats.minimax import MiniMaxFormat
from tests.chat.formats.util import accepts, calls, forced, parse

MINIMAX = MiniMaxFormat()


def invoke(name: str, params: dict[str, str]) -> str:
    body = "".join(f'<parameter name="{k}">{v}</parameter>\n' for k, v in params.items())
    return f'<invoke name="{name}">\n{body}</invoke>\n'


def test_prompt_opened_thinking_then_parallel_invokes_in_one_section():
    text = (
        "Two cities.\n</think>\n\nChecking.<minimax:tool_call>\n"
        + invoke("get_weather", {"city": "Paris", "days": "3"})
        + invoke("get_time", {"zone": "Asia/Tokyo", "n": "[1, 2]"})
        + "</minimax:tool_call>"
    )
    out = parse(MINIMAX, text, prompt="]~b]ai\n<think>\n")
    assert out == [
        {"thinking": "Two cities.\n"},
        {"content": "Checking."},
        {
            "tool_calls": [
                {"function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}}
            ]
        },
        {
            "tool_calls": [
                {"function": {"name": "get_time", "arguments": {"zone": "Asia/Tokyo", "n": [1, 2]}}}
            ]
        },
    ]


def test_two_sections_and_quoting_of_names():
    text = (
        "<minimax:tool_call><invoke name='get_time'></invoke></minimax:tool_call> and "
        '<minimax:tool_call><invoke name=get_weather><parameter name="city">a "quote" {'
        "</parameter></invoke></minimax:tool_call>"
    )
    out = parse(MINIMAX, text)
    assert calls(out) == [
        {"name": "get_time", "arguments": {}},
        {"name": "get_weather", "arguments": {"city": 'a "quote" {'}},
    ]
    assert {"content": " and "} in out


def test_broken_and_cut_calls_are_shown_without_markup():
    cut = '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Par'
    assert parse(MINIMAX, cut) == [{"content": "Par"}]
    junk = '<minimax:tool_call><invoke name="get_time">oops</invoke></minimax:tool_call>'
    assert parse(MINIMAX, junk) == [{"content": "oops"}]
    # a call whose section never closed still counts once its invoke has
    assert calls(parse(MINIMAX, '<minimax:tool_call><invoke name="get_time"></invoke>')) == [
        {"name": "get_time", "arguments": {}}
    ]


def test_calls_follow_the_schema_with_bare_text_values():
    grammar = forced(MINIMAX)
    both = invoke("get_weather", {"city": "Paris", "days": "2"}) + invoke("get_time", {})
    good = f"<minimax:tool_call>\n{both}</minimax:tool_call>"
    assert accepts(grammar, good) and len(calls(parse(MINIMAX, good))) == 2
    bad = invoke("get_weather", {"city": "Paris", "days": "two"})
    assert not accepts(grammar, f"<minimax:tool_call>\n{bad}</minimax:tool_call>")
    assert not accepts(forced(MINIMAX, "get_time"), good)
