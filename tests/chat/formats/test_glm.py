"""GLM-4.5's and GLM-4.7's `<arg_key>`/`<arg_value>` calls, typed by the tool's schema."""

from __future__ import annotations

from freetoken.chat.formats.glm import GlmFormat
from tests.chat.formats.util import TOOLS, accepts, calls, forced, options, parse, run

GLM = GlmFormat()


def call(name: str, pairs: dict[str, str], sep: str = "\n") -> str:
    body = "".join(
        f"{sep}<arg_key>{k}</arg_key>{sep}<arg_value>{v}</arg_value>" for k, v in pairs.items()
    )
    return f"<tool_call>{name}{body}{sep}</tool_call>"


def test_thinking_content_then_parallel_calls_with_typed_values():
    text = (
        "\n<think>Two cities.</think>\nChecking."
        + call("get_weather", {"city": "007", "days": "3"})
        + "\n"
        + call("get_time", {"zone": "Asia/Tokyo", "n": "[1, 2]"})
    )
    assert parse(GLM, text) == [
        {"thinking": "Two cities."},
        {"content": "Checking."},
        # the schema says city is a string: "007" stays text; days is an integer
        {
            "tool_calls": [
                {"function": {"name": "get_weather", "arguments": {"city": "007", "days": 3}}}
            ]
        },
        {"content": "\n"},
        {
            "tool_calls": [
                {"function": {"name": "get_time", "arguments": {"zone": "Asia/Tokyo", "n": [1, 2]}}}
            ]
        },
    ]


def test_glm47_writes_no_newlines_and_unknown_parameters_are_text():
    text = call("get_weather", {"city": 'a "b" {c', "extra": "42"}, sep="")
    assert calls(parse(GLM, text)) == [
        {"name": "get_weather", "arguments": {"city": 'a "b" {c', "extra": "42"}}
    ]
    assert calls(parse(GLM, "<tool_call>get_time</tool_call>")) == [
        {"name": "get_time", "arguments": {}}
    ]


def test_a_value_that_is_not_json_where_json_is_due_stays_text():
    assert calls(parse(GLM, call("get_weather", {"days": "three"}))) == [
        {"name": "get_weather", "arguments": {"days": "three"}}
    ]


def test_broken_and_cut_calls_are_shown_without_markup():
    cut = "ok<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par"
    assert parse(GLM, cut) == [{"content": "okget_weather\ncity\nPar"}]
    junk = "<tool_call>get_weather\nnot a pair</tool_call>after"
    assert parse(GLM, junk) == [{"content": "get_weather\nnot a pairafter"}]
    assert parse(GLM, "<tool_call>\n</tool_call>x") == [{"content": "x"}]


def test_prompt_opened_thinking_and_no_tools():
    assert parse(GLM, "a</think>b", prompt="<|assistant|><think>") == [
        {"thinking": "a"},
        {"content": "b"},
    ]
    text = "<tool_call>get_time</tool_call>"
    assert run(lambda: GLM.parser(options(tools=False)), text) == [{"content": text}]


def test_calls_follow_the_schema_with_bare_text_values():
    grammar = forced(GLM)
    good = call("get_weather", {"city": "Paris </arg_key> x", "days": "3"})
    assert accepts(grammar, good) and calls(parse(GLM, good))[0]["arguments"]["days"] == 3
    assert accepts(grammar, call("get_weather", {"city": "Rome"}, sep=""))  # GLM-4.7's form
    assert accepts(grammar, good + "\n" + call("get_time", {"n": "[1, 2]"}))  # parallel
    assert not accepts(grammar, call("get_weather", {"days": "3"}))  # city is required
    assert not accepts(grammar, call("get_weather", {"city": "a", "days": "x"}))  # an integer
    assert not accepts(grammar, call("get_weather", {"city": "a", "when": "now"}))  # no such key
    assert not accepts(forced(GLM, "get_time"), good)
    # under auto: free text, and a call once its marker is written
    auto = GLM.auto_grammar([t["function"] for t in TOOLS])
    assert accepts(auto, "Let me see. " + good + " Done.")
    assert not accepts(auto, "Let me see. " + call("get_weather", {"days": "3"}))
