"""Template functions: Go's builtins and Ollama's additions, with Go's error messages."""

from __future__ import annotations

import datetime

import pytest

from freetoken.chat.errors import TemplateError
from freetoken.chat.gofuncs import sprintf
from freetoken.chat.govalues import Struct
from tests.chat.test_goeval import run


def test_and_or_return_an_operand_and_stop_early():
    assert run('{{ and 1 0 2 }}|{{ and 1 2 }}|{{ or 0 "" "x" }}|{{ or 0 "" }}') == "0|2|x|"
    assert run("{{ 0 | and 1 }}") == "0"
    # the operand after the deciding one is never evaluated, so its error never happens
    src = "{{ and false (index .Xs 5) }} {{ or true (index .Xs 5) }}"
    assert run(src, {"Xs": []}) == "false true"
    with pytest.raises(TemplateError, match="index out of range: 5"):
        run("{{ and true (index .Xs 5) }}", {"Xs": []})


def test_comparisons():
    assert (
        run('{{ eq 1 1 }} {{ eq "a" "b" "a" }} {{ eq .Missing "x" }} {{ eq 1 1.0 }}', {})
        == "true true false true"
    )
    assert (
        run('{{ ne "a" "b" }} {{ lt 1 2 }} {{ le 2 2 }} {{ gt "b" "a" }} {{ ge 1 2 }}')
        == "true true true true false"
    )
    with pytest.raises(TemplateError, match="error calling eq: incompatible types for comparison"):
        run('{{ eq 1 "1" }}')
    with pytest.raises(TemplateError, match="non-comparable type"):
        run("{{ eq .L .L }}", {"L": [1]})
    with pytest.raises(TemplateError, match="invalid type for comparison"):
        run("{{ lt true false }}")


def test_len_index_slice():
    data = {"Xs": ["a", "b", "c"], "M": {"a": [7, 8]}}
    assert run('{{ len "héllo" }} {{ len .Xs }} {{ len .M }}', data) == "6 3 1"  # bytes, as Go
    src = '{{ index .Xs 1 }} {{ index .M "a" 1 }} {{ index .M "zz" }} {{ index "abc" 1 }}'
    assert run(src, data) == "b 8 <no value> 98"
    src = '{{ slice .Xs 1 }} {{ slice .Xs 1 2 }} {{ slice .Xs }} {{ slice "hello" 1 3 }}'
    assert run(src, data) == "[b c] [b] [a b c] el"
    for src, message in [
        ("{{ len 3 }}", "error calling len: len of type int"),
        ("{{ index .Xs 3 }}", "error calling index: index out of range: 3"),
        ('{{ index .Xs "a" }}', "cannot index slice/array with type string"),
        ("{{ slice .Xs 2 1 }}", "invalid slice index: 2 > 1"),
        ("{{ slice .Xs 9 }}", "index out of range: 9"),
        ("{{ len }}", "wrong number of args for len: want 1 got 0"),
        ("{{ not 1 2 }}", "wrong number of args for not: want 1 got 2"),
        ("{{ eq 1 }}", "wrong number of args for eq: want at least 2 got 1"),
    ]:
        with pytest.raises(TemplateError, match=message):
            run(src, data)


def test_print_println():
    assert run('{{ print "a" 1 2 "b" true }}') == "a1 2btrue"  # a space only between non-strings
    assert run('{{ println "a" 1 }}') == "a 1\n"


def test_printf_verbs():
    src = (
        '{{ printf "%s|%d|%v|%q|%5.2f|%-4s|%03d|%x|%t|%%|%T"'
        ' "s" 42 .L "q\\"" 3.14159 "ab" 7 255 true .L }}'
    )
    assert run(src, {"L": [1, 2]}) == 's|42|[1 2]|"q\\""| 3.14|ab  |007|ff|true|%|[]interface {}'
    assert sprintf("%d", "x") == "%!d(string=x)"
    assert sprintf("%s %s", "a") == "a %!s(MISSING)"
    assert sprintf("%s", "a", "b") == "a%!(EXTRA string=b)"
    assert (
        sprintf("%.3s|%+d|%e|%g|%c|%q", "abcdef", 5, 1234.5, 0.5, 65, 97)
        == "abc|+5|1.234500e+03|0.5|A|'a'"
    )
    with pytest.raises(TemplateError, match="expected string; got int"):
        run("{{ printf 3 }}")


def test_json_is_compact_go_json_in_the_given_key_order():
    value = {"b": [1, 2.5, None, True, 3.0, 1e21, 1e-7], "a": '<tag> & "q"\n', "é": "ü"}
    assert (
        run("{{ json . }}", value)
        == '{"b":[1,2.5,null,true,3,1e+21,1e-7],"a":"\\u003ctag\\u003e \\u0026 \\"q\\"\\n","é":"ü"}'
    )
    assert run("{{ json . }}", Struct("T", {"A": 1}, {"a": 1})) == '{"a":1}'
    assert run("{{ json . }}", Struct("T", {"A": 1})) == '{"A":1}'  # no JSON form: Go field names


def test_current_date():
    today = datetime.date.today().isoformat()
    assert run('{{ currentDate }}|{{ currentDate "2006" }}') == f"{today}|{today}"


def _prop(schema: dict) -> Struct:
    return Struct("ToolProperty", {}, schema)


@pytest.mark.parametrize(
    "schema, ts",
    [
        ({"type": "string"}, "string"),
        ({"type": ["string", "null"]}, "string | null"),
        ({"type": "integer"}, "number"),
        ({"type": "array", "items": {"type": "string"}}, "any[]"),
        ({"type": "object"}, "Record<string, any>"),
        ({"anyOf": [{"type": "boolean"}, {"type": "number"}]}, "boolean | number"),
        ({"description": "no type"}, "any"),
    ],
)
def test_to_typescript_type_of_a_property(schema, ts):
    assert run("{{ toTypeScriptType . }}", _prop(schema)) == ts
    assert run("{{ toTypeScriptType . }}", schema) == ts  # a plain schema object reads the same


def test_to_typescript_type_of_a_parameters_object():
    params = Struct(
        "ToolFunctionParameters",
        {},
        {
            "type": "object",
            "required": ["city"],
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "a-b": {}},
        },
    )
    assert run("{{ toTypeScriptType . }}", params) == '{ city: string, days?: number, "a-b"?: any }'
    assert run("{{ toTypeScriptType . }}", 3) == "any"
