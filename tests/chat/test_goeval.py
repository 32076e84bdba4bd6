"""The Go text/template interpreter, construct by construct. Expected outputs are worked
out by hand from Go's documented semantics."""

from __future__ import annotations

import pytest

from freetoken.chat.errors import TemplateError
from freetoken.chat.goeval import execute
from freetoken.chat.gofuncs import FUNCS
from freetoken.chat.goparse import parse
from freetoken.chat.govalues import Struct


def run(source: str, data: object = None) -> str:
    return execute(parse(source, FUNCS), data)


def test_text_fields_and_dot():
    assert run("Hello, {{ .Name }}!", {"Name": "Ada"}) == "Hello, Ada!"
    assert run("{{ . }}", "dot") == "dot"
    assert run("{{ .A.B.C }}", {"A": {"B": {"C": 7}}}) == "7"
    assert run("{{ $.A }}", {"A": 1}) == "1"
    data = {"Xs": ["a", "b"], "Sep": "-"}
    assert run("{{ range .Xs }}{{ $.Sep }}{{ . }}{{ end }}", data) == "-a-b"


def test_missing_map_key_is_nil():
    # Ollama runs templates with missingkey=zero: nil prints as "<no value>" and is false
    assert run("[{{ .Nope }}]", {}) == "[<no value>]"
    assert run("{{ if .Nope }}y{{ else }}n{{ end }}", {}) == "n"
    with pytest.raises(TemplateError, match=r"nil pointer evaluating interface \{\}\.B"):
        run("{{ .A.B }}", {})


def test_struct_fields():
    msg = Struct("Message", {"Role": "user", "Content": "hi"})
    assert run("{{ .Role }}: {{ .Content }}", msg) == "user: hi"
    with pytest.raises(TemplateError, match="can't evaluate field Nope in type Message"):
        run("{{ .Nope }}", msg)
    with pytest.raises(TemplateError, match="can't evaluate field X in type string"):
        run("{{ .X }}", "text")


def test_trim_markers_and_comments():
    assert run("a  {{- 1 -}}  \n b") == "a1b"
    assert run("a {{- 1 }} b") == "a1 b"
    assert run("1 {{- 2 }} {{ 3 -}} \t\n 4") == "12 34"
    assert run("x\n\n{{- /* a note */ -}}\n\ny") == "xy"
    assert run("a{{/* c */}}b") == "ab"
    assert run("a\n{{- /* multi\nline */}}\nb") == "a\nb"
    assert run("{{-3}}") == "-3"  # no space after the dash: a negative number, not a trim


def test_literals():
    assert run('{{ "a\\tb\\u00e9\\x41\\101\\"" }}') == 'a\tbéAA"'
    assert run("{{ `raw\\n` }}") == "raw\\n"
    assert (
        run("{{ 42 }} {{ -1.5 }} {{ 0x1F }} {{ 1e3 }} {{ 'a' }} {{ 1_000 }} {{ 010 }}")
        == "42 -1.5 31 1000 97 1000 8"
    )
    assert run("{{ true }} {{ false }}") == "true false"
    with pytest.raises(TemplateError, match="nil is not a command"):
        run("{{ nil }}")


def test_pipelines():
    assert run('{{ "hi" | printf "%s!" }}') == "hi!"
    assert run('{{ .X | len | printf "%d items" }}', {"X": [1, 2, 3]}) == "3 items"
    assert run('{{ printf "%d-%d" (len .X) (index .X 0) }}', {"X": [5, 6]}) == "2-5"
    assert run("{{ (index .Xs 1).Name }}", {"Xs": [{"Name": "a"}, {"Name": "b"}]}) == "b"
    with pytest.raises(TemplateError, match="X is not a method but has arguments"):
        run("{{ .X 1 }}", {"X": 1})
    with pytest.raises(TemplateError, match="can't give argument to non-function"):
        run('{{ "a" | "b" }}')


def test_variables_and_scopes():
    assert run('{{ $x := "a" }}{{ $x }}{{ $x = "b" }}{{ $x }}') == "ab"
    assert run("{{ $x := 1 }}{{ if true }}{{ $x := 2 }}{{ $x }}{{ end }}{{ $x }}") == "21"
    assert run("{{ $x := 1 }}{{ if true }}{{ $x = 2 }}{{ end }}{{ $x }}") == "2"
    assert run("{{ if $v := .X }}{{ $v }}{{ end }}", {"X": "x"}) == "x"
    src = '{{ $o := "?" }}{{ range .Xs }}{{ if eq . "b" }}{{ $o = "" }}{{ end }}{{ end }}[{{ $o }}]'
    assert run(src, {"Xs": ["a", "b"]}) == "[]"
    with pytest.raises(TemplateError, match='undefined variable "\\$y"'):
        run("{{ if true }}{{ $y := 1 }}{{ end }}{{ $y }}")


def test_if_else_chains():
    src = "{{ if .A }}a{{ else if .B }}b{{ else }}c{{ end }}"
    assert [run(src, d) for d in ({"A": 1}, {"B": 1}, {})] == ["a", "b", "c"]
    assert run("{{ if .A }}a{{ else if .B }}b{{ end }}.", {}) == "."


def test_with_and_else_with():
    src = "{{ with .U }}{{ .Name }}{{ else }}nobody{{ end }}"
    assert run(src, {"U": {"Name": "Ada"}}) == "Ada"
    assert run(src, {"U": {}}) == "nobody"
    src = "{{ with .A }}A={{ . }}{{ else with .B }}B={{ . }}{{ else }}none{{ end }}"
    assert [run(src, d) for d in ({"A": 1}, {"B": 2}, {})] == ["A=1", "B=2", "none"]


def test_range():
    xs = {"Xs": ["a", "b", "c"]}
    assert run("{{ range $i, $v := .Xs }}{{ $i }}={{ $v }};{{ end }}", xs) == "0=a;1=b;2=c;"
    assert run("{{ range $v := .Xs }}{{ $v }}{{ end }}", xs) == "abc"
    last = "{{ range $i, $_ := .Xs }}{{ if eq (len (slice $.Xs $i)) 1 }}{{ . }}{{ end }}{{ end }}"
    assert run(last, xs) == "c"
    src = "{{ range $k, $v := .M }}{{ $k }}:{{ $v }} {{ end }}"
    assert run(src, {"M": {"b": 2, "a": 1, "c": 3}}) == "a:1 b:2 c:3 "  # in key order
    src = "{{ range .Rows }}[{{ range . }}{{ . }}{{ end }}]{{ end }}"
    assert run(src, {"Rows": [[1, 2], [3]]}) == "[12][3]"
    assert run("{{ range 3 }}{{ . }}{{ end }}") == "012"
    for empty in ({"Xs": []}, {}):
        assert run("{{ range .Xs }}x{{ else }}empty{{ end }}", empty) == "empty"
    with pytest.raises(TemplateError, match="range can't iterate over abc"):
        run("{{ range . }}{{ end }}", "abc")


def test_break_and_continue():
    src = (
        "{{ range .Xs }}{{ if eq . 2 }}{{ continue }}{{ end }}"
        "{{ if eq . 4 }}{{ break }}{{ end }}{{ . }}{{ end }}"
    )
    assert run(src, {"Xs": [1, 2, 3, 4, 5]}) == "13"


def test_define_template_and_block():
    src = '{{ define "greet" }}Hi {{ . }}{{ end }}{{ template "greet" .Name }}!'
    assert run(src, {"Name": "Ada"}) == "Hi Ada!"
    assert run('{{ define "t" }}{{ $ }}{{ end }}{{ template "t" "x" }}') == "x"
    assert run('{{ define "t" }}[{{ . }}]{{ end }}{{ template "t" }}') == "[<no value>]"
    assert run('{{ block "b" .X }}<{{ . }}>{{ end }}', {"X": 1}) == "<1>"
    with pytest.raises(TemplateError, match='no such template "nope"'):
        run('{{ template "nope" }}')
    with pytest.raises(TemplateError, match="exceeded maximum template depth"):
        run('{{ define "r" }}{{ template "r" . }}{{ end }}{{ template "r" }}')


@pytest.mark.parametrize(
    "value, truth",
    [
        (False, False),
        (True, True),
        (0, False),
        (1, True),
        (0.0, False),
        (-0.5, True),
        ("", False),
        ("0", True),
        ("false", True),
        ([], False),
        ([0], True),
        ({}, False),
        ({"a": 0}, True),
        (None, False),
        (Struct("Empty", {}), True),
    ],
)
def test_go_truthiness(value, truth):
    assert run("{{ if . }}T{{ else }}F{{ end }}", value) == ("T" if truth else "F")
    assert run("{{ not . }}", value) == ("false" if truth else "true")


@pytest.mark.parametrize(
    "value, printed",
    [
        (["a", 1, True, None], "[a 1 true <nil>]"),
        ({"b": 1, "a": [1, 2]}, "map[a:[1 2] b:1]"),
        (1.5, "1.5"),
        (2.0, "2"),
        (123456.0, "123456"),
        (1e6, "1e+06"),
        (1234567.0, "1.234567e+06"),
        (0.0001, "0.0001"),
        (1e-5, "1e-05"),
        (-2.5e-7, "-2.5e-07"),
    ],
)
def test_values_print_as_go_prints_them(value, printed):
    assert run("{{ . }}", value) == printed


def test_errors_name_the_position():
    with pytest.raises(TemplateError) as e:
        run("ab\n  {{ index .Xs 3 }}", {"Xs": []})
    assert str(e.value) == "template: line 2, column 6: error calling index: index out of range: 3"
