"""What `format` and `tool_choice` make of a request: the effective choice and the grammars
(compiled by the engine over a vocabulary of single bytes, so any text is a token walk)."""

from __future__ import annotations

import json

import pytest

from freetoken import options as opts
from freetoken.chat.formats.parser import OutputParser
from freetoken.chat.formats.qwen import QwenFormat
from freetoken.chat.grammar import Lark, json_format, lit
from freetoken.chat.structured import SchemaError, forced_tools, named_calls, tool_choice
from tests.chat.formats.util import accepts

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "now"}},  # no parameters: any object
]
USER = [{"role": "user", "content": "hi"}]
AFTER_TOOL = USER + [{"role": "assistant", "content": ""}, {"role": "tool", "content": "22"}]


@pytest.mark.parametrize(
    "request_choice, option, messages, tools, want",
    [
        (None, None, USER, TOOLS, ("auto", None)),
        ("none", "required", USER, TOOLS, ("none", None)),  # the request wins
        ("required", None, AFTER_TOOL, TOOLS, ("required", None)),  # asked for: always
        ({"type": "function", "function": {"name": "now"}}, None, USER, TOOLS, ("required", "now")),
        (None, "required", USER, TOOLS, ("required", None)),
        (None, "required", AFTER_TOOL, TOOLS, ("auto", None)),  # the option lapses after a result
        (None, "required", USER, None, ("auto", None)),  # and without tools
        (None, "none", USER, TOOLS, ("none", None)),
        # SDKs send "auto" with every request that has tools: it leaves the option in force
        ("auto", "required", USER, TOOLS, ("required", None)),
        ("auto", "none", USER, TOOLS, ("none", None)),
        ("auto", None, USER, TOOLS, ("auto", None)),
    ],
)
def test_effective_tool_choice(request_choice, option, messages, tools, want):
    assert tool_choice(request_choice, option, messages, tools) == want


@pytest.mark.parametrize(
    "request_choice, option",
    [
        ("always", None),
        ({"type": "function"}, None),
        ({"type": "x", "function": {"name": "a"}}, None),
        (None, "sometimes"),
    ],
)
def test_invalid_tool_choice(request_choice, option):
    with pytest.raises(SchemaError):
        tool_choice(request_choice, option, USER, TOOLS)


def test_tool_choice_is_an_option_a_modelfile_may_set():
    assert opts.coerce("tool_choice", "required", from_text=True) == "required"
    assert opts.validate({"tool_choice": "none"}) == {"tool_choice": "none"}
    with pytest.raises(opts.OptionError):
        opts.validate({"tool_choice": 1})


def test_forced_calls_follow_the_tools_schemas():
    g = QwenFormat().call_grammar(forced_tools(TOOLS, None))
    good = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert accepts(g, good)
    assert accepts(g, '<tool_call>{"name": "now", "arguments": {"any": [1]}}</tool_call>')
    assert not accepts(g, '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>')
    assert not accepts(g, '<tool_call>{"name": "other", "arguments": {}}</tool_call>')
    assert not accepts(g, '{"name": "now", "arguments": {}}')
    assert not accepts(g, good + " and more")
    # whitespace is bounded: the compact layout only, no newlines or tabs inside the JSON
    assert not accepts(g, '<tool_call>{"name": "now",\n\t"arguments": {}}</tool_call>')
    assert not accepts(g, '<tool_call>{"name":"now", "arguments": {}}</tool_call>')
    parser = OutputParser(QwenFormat(), tools=True)
    events = parser.feed(good) + parser.finish()
    assert events == [
        {"tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    ]
    bare = QwenFormat(call_open=None, call_close=None)  # a template without call markers
    named = bare.call_grammar(forced_tools(TOOLS, "now"))
    assert accepts(named, '{"name": "now", "arguments": {}}')
    assert not accepts(named, '{"name": "get_weather", "arguments": {"city": "x"}}')


def test_a_forced_call_with_a_nullable_anyof_beside_a_type():
    # the shape of OpenClaw's tool_search parameters: only the string branch is possible
    tool = {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {
                "type": "object",
                "required": ["q"],
                "properties": {
                    "q": {
                        "anyOf": [{"type": "string", "enum": ["x"]}, {"type": "null"}],
                        "type": "string",
                    }
                },
            },
        },
    }
    g = QwenFormat().call_grammar(forced_tools([tool], None))
    assert accepts(g, '<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>')
    assert not accepts(g, '<tool_call>{"name": "search", "arguments": {"q": null}}</tool_call>')


def test_tool_choice_refusals():
    with pytest.raises(SchemaError, match="needs tools"):
        forced_tools([], None)
    with pytest.raises(SchemaError, match="not among"):
        forced_tools(TOOLS, "nope")
    bad = [{"type": "function", "function": {"name": "x", "parameters": "nope"}}]
    with pytest.raises(SchemaError, match='tool "x"'):
        QwenFormat().call_grammar(forced_tools(bad, None))


def test_format_grammar():
    assert accepts(json_format("json"), json.dumps({"a": [1, None]}))
    assert not accepts(json_format("json"), "[1]")  # "json" means an object
    assert not accepts(json_format("json"), '{"a":1}')  # the compact layout: ", " and ": "
    with pytest.raises(SchemaError):
        json_format("yaml")


def test_objects_that_list_properties_take_no_others_unless_merged():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert not accepts(json_format(schema), '{"a": 1, "b": 2}')
    opened = {**schema, "additionalProperties": True}
    assert accepts(json_format(opened), '{"a": 1, "b": 2}')
    merged = {"allOf": [schema, {"properties": {"b": {"type": "integer"}}}]}
    assert accepts(json_format(merged), '{"a": 1, "b": 2}')


def test_the_grammar_side_never_imports_torch():
    import subprocess
    import sys

    code = (
        "import sys, freetoken.chat.structured, freetoken.chat.grammar, freetoken.chat.formats\n"
        "assert 'torch' not in sys.modules"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_named_calls_name_the_tool_in_the_markup():
    tools = [
        {"name": "get", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}},
        {"name": "get_all", "parameters": {"type": "object", "additionalProperties": False}},
    ]

    def grammar(fns):
        lark = Lark()

        def around(fn):
            return lit(f"<call {fn}>"), lit(f"</call {fn}>")

        return lark.grammar(named_calls(lark, fns, False, around))

    g = grammar(forced_tools(tools, None))
    assert accepts(g, '<call get>{"a": 1}</call get>')
    assert accepts(g, "<call get_all>{}</call get_all>")
    assert not accepts(g, "<call get>{}</call get_all>")  # each tool its own close
    assert not accepts(g, '<call get_all>{"a": 1}</call get_all>')
    assert not accepts(g, '<call get>{"a": "x"}</call get>')
    only = grammar(forced_tools(tools, "get_all"))
    assert accepts(only, "<call get_all>{}</call get_all>")
    assert not accepts(only, '<call get>{"a": 1}</call get>')
