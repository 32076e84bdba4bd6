"""DeepSeek-V4's DSML `<｜DSML｜tool_calls>` sections of invokes."""

from __future__ import annotations

from freetoken.chat.formats.dsml import DsmlFormat
from tests.chat.formats.util import accepts, calls, forced, parse

DSML = DsmlFormat()
D = "｜DSML｜"


def invoke(name: str, params: dict[str, tuple[str, str]]) -> str:
    """An invoke whose parameters are (string mark, value as written)."""
    body = "".join(
        f'<{D}parameter name="{k}" string="{mark}">{v}</{D}parameter>\n'
        for k, (mark, v) in params.items()
    )
    return f'<{D}invoke name="{name}">\n{body}</{D}invoke>\n'


def section(*invokes: str) -> str:
    return f"<{D}tool_calls>\n" + "".join(invokes) + f"</{D}tool_calls>"


def test_prompt_opened_thinking_then_parallel_invokes_in_one_section():
    text = "Two cities.\n</think>\n\nChecking.\n\n" + section(
        invoke("get_weather", {"city": ("true", "Paris"), "days": ("false", "3")}),
        invoke("get_time", {"zone": ("true", "Asia/Tokyo"), "n": ("false", "[1, 2]")}),
    )
    out = parse(DSML, text, prompt="<｜Assistant｜><think>")
    assert out[0] == {"thinking": "Two cities.\n"}
    assert out[1]["content"].strip() == "Checking."
    assert calls(out) == [
        {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}},
        {"name": "get_time", "arguments": {"zone": "Asia/Tokyo", "n": [1, 2]}},
    ]


def test_the_string_mark_says_how_a_value_is_read():
    # marked text stays text even where it would parse as JSON; marked JSON is JSON
    text = section(invoke("get_time", {"zone": ("true", "[1]"), "n": ("false", '["a"]')}))
    assert calls(parse(DSML, text)) == [
        {"name": "get_time", "arguments": {"zone": "[1]", "n": ["a"]}}
    ]
    # JSON that does not parse, and values with no mark, are read as the schema says
    odd = (
        f"<{D}tool_calls><{D}invoke name='get_weather'>"
        f'<{D}parameter name="city" string="false">Paris</{D}parameter>'
        f'<{D}parameter name="days">4</{D}parameter>'
        f"</{D}invoke></{D}tool_calls>"
    )
    assert calls(parse(DSML, odd)) == [
        {"name": "get_weather", "arguments": {"city": "Paris", "days": 4}}
    ]


def test_broken_and_cut_calls_are_shown_without_markup():
    cut = f'<{D}tool_calls>\n<{D}invoke name="get_weather">\n'
    cut += f'<{D}parameter name="city" string="true">Par'
    assert parse(DSML, cut) == [{"content": "Par"}]
    junk = f'<{D}tool_calls><{D}invoke name="get_time">oops</{D}invoke></{D}tool_calls>'
    assert parse(DSML, junk) == [{"content": "oops"}]
    unclosed = f'<{D}tool_calls><{D}invoke name="get_time"></{D}invoke>'
    assert calls(parse(DSML, unclosed)) == [{"name": "get_time", "arguments": {}}]


def test_calls_follow_the_schema_with_marked_values():
    grammar = forced(DSML)
    both = invoke("get_weather", {"city": ("true", "Paris"), "days": ("false", "2")})
    both += invoke("get_time", {})
    good = section(both)
    assert accepts(grammar, good) and len(calls(parse(DSML, good))) == 2
    wrong_mark = invoke("get_weather", {"city": ("false", "Paris")})
    assert not accepts(grammar, section(wrong_mark))
    bad = invoke("get_weather", {"city": ("true", "Paris"), "days": ("false", "two")})
    assert not accepts(grammar, section(bad))
    assert not accepts(forced(DSML, "get_time"), good)
