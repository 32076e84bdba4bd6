"""gpt-oss's Harmony messages: analysis is thinking, a recipient makes a call, the rest is
content."""

from __future__ import annotations

import pytest

from freetoken.chat.formats.harmony import HarmonyFormat
from tests.chat.formats.util import (
    accepts,
    calls,
    forced,
    options,
    parse,
    run,
    streamed_arguments,
)

HARMONY = HarmonyFormat()
OPENED = "<|start|>user<|message|>hi<|end|><|start|>assistant"


def test_analysis_then_final():
    text = (
        "<|channel|>analysis<|message|>User says hi.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Hello!<|return|>"
    )
    assert parse(HARMONY, text, prompt=OPENED) == [
        {"thinking": "User says hi."},
        {"content": "Hello!"},
    ]


def test_analysis_preamble_then_a_call():
    text = (
        "<|channel|>analysis<|message|>Need weather.<|end|>"
        "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Paris", "days": 3}'
    )
    out = parse(HARMONY, text, prompt=OPENED, stream_calls=True)
    assert [e for e in out if "tool_call_delta" not in e] == [
        {"thinking": "Need weather."},
        {"content": "Checking."},
        {"tool_call_start": {"index": 0, "name": "get_weather"}},
        {
            "tool_calls": [
                {"function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}}
            ],
            "streamed": True,
        },
    ]
    assert streamed_arguments(out) == {0: {"city": "Paris", "days": 3}}


def test_recipient_before_the_channel_and_calls_that_end_with_call():
    text = (
        '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"n": [1]}'
        "<|call|><|start|>assistant<|channel|>commentary to=functions.get_weather"
        '<|message|>{"city": "Oslo"}<|call|>'
    )
    assert calls(parse(HARMONY, text, prompt="<|end|>")) == [
        {"name": "get_time", "arguments": {"n": [1]}},
        {"name": "get_weather", "arguments": {"city": "Oslo"}},
    ]


@pytest.mark.parametrize(
    "prompt, text, want",
    [
        # the prompt opened the final message's body
        (OPENED + "<|channel|>final<|message|>", "Hi there", [{"content": "Hi there"}]),
        # other channels are content; a message the model never ended is ended by the next
        (OPENED, "<|channel|>notes<|message|>a<|channel|>final<|message|>b", [{"content": "ab"}]),
        # no header at all
        (OPENED, "Just text.", [{"content": "Just text."}]),
        (OPENED, "<|channel|>analysis<|message|>cut sho", [{"thinking": "cut sho"}]),
        (OPENED, "<|channel|>analys", []),
    ],
)
def test_other_shapes(prompt, text, want):
    assert parse(HARMONY, text, prompt=prompt) == want


def test_think_false_drops_analysis_and_without_tools_a_call_is_content():
    text = (
        "<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_time<|message|>{"n": 1}'
    )
    assert parse(HARMONY, text, prompt=OPENED, show_thinking=False)[0] == {
        "tool_calls": [{"function": {"name": "get_time", "arguments": {"n": 1}}}]
    }
    assert run(lambda: HARMONY.parser(options(tools=False)), text) == [
        {"thinking": "x"},
        {"content": '{"n": 1}'},
    ]


def test_broken_arguments_are_shown_without_markup():
    text = "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{oops<|call|>"
    assert parse(HARMONY, text, prompt=OPENED) == [{"content": "{oops"}]


def test_forced_calls_and_reasoning_effort():
    grammar = forced(HARMONY)
    good = (
        "<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Paris"}'
    )
    assert accepts(grammar, good) and calls(parse(HARMONY, good, prompt=OPENED))
    assert not accepts(forced(HARMONY, "get_time"), good)
    assert HARMONY.template_variables("max")["reasoning_effort"] == "high"
    assert "reasoning_effort" not in HARMONY.template_variables(True)
