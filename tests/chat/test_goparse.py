"""Malformed templates fail at parse time with Go's reason and where it is."""

from __future__ import annotations

import pytest

from freetoken.chat import template
from freetoken.chat.errors import TemplateError
from freetoken.chat.gofuncs import FUNCS
from freetoken.chat.goparse import Branch, Field, parse


@pytest.mark.parametrize(
    "source, message",
    [
        ("A{{ range .Xs }}x", "line 1, column 2: unclosed {{ range }}: missing {{ end }}"),
        ("a\nb {{ if .X }}\n{{ range .Y }}{{ end }}", "line 2, column 3: unclosed {{ if }}"),
        ("{{ if .X }}{{ else }}", "line 1, column 1: unclosed {{ if }}: missing {{ end }}"),
        ('{{ define "x" }}', "line 1, column 1: unclosed {{ define }}: missing {{ end }}"),
        ("{{ .X | upper }}", 'line 1, column 9: function "upper" not defined'),
        ("{{ $x }}", 'line 1, column 4: undefined variable "$x"'),
        ("x{{ end }}", "line 1, column 2: unexpected {{ end }}"),
        ("{{ else }}", "line 1, column 1: unexpected {{ else }}"),
        ("{{ range .X }}{{ else }}{{ else }}{{ end }}", "line 1, column 25: unexpected {{ else }}"),
        ("{{ break }}", "line 1, column 1: {{ break }} outside {{ range }}"),
        (
            '{{ define "x" }}{{ range . }}{{ end }}{{ continue }}{{ end }}',
            "line 1, column 39: {{ continue }} outside {{ range }}",
        ),
        ("ab{{ .X ", "line 1, column 3: unclosed action: missing }}"),
        ("{{/* x", "line 1, column 1: unclosed comment"),
        ("{{/* x */ .X }}", "line 1, column 1: comment ends before closing delimiter"),
        ("{{ }}", "line 1, column 4: missing value for command"),
        ("{{ if }}{{ end }}", "line 1, column 7: missing value for if"),
        ('{{ "abc }}', "line 1, column 4: unterminated quoted string"),
        ('{{ "\\q" }}', "line 1, column 4: unknown escape sequence \\q"),
        ("{{ 'ab' }}", "line 1, column 4: malformed character constant: 'ab'"),
        ("{{ 0x }}", "line 1, column 4: bad number syntax: '0x'"),
        ('{{ if 1 }}{{ define "x" }}{{ end }}{{ end }}', "line 1, column 11: {{ define }} is only"),
        ("{{ if $a, $b := .X }}{{ end }}", "line 1, column 7: too many declarations in if"),
        ("{{ .X ) }}", "line 1, column 7: unexpected ')' in command"),
        ("{{ (.X }}", "line 1, column 8: unexpected }} in parenthesized pipeline"),
        ("{{ template .X }}", "line 1, column 13: unexpected <.X> in template clause"),
        ("{{ .X ? }}", "line 1, column 7: unexpected '?' in action"),
    ],
)
def test_parse_errors(source, message):
    with pytest.raises(TemplateError) as e:
        parse(source, FUNCS)
    assert str(e.value).startswith(f"template: {message}")


def test_the_error_type_is_the_one_template_exports():
    assert TemplateError is template.TemplateError and issubclass(TemplateError, ValueError)


def test_else_if_nests_in_the_else_branch():
    tree = parse("{{ if .A }}a{{ else if .B }}b{{ else }}c{{ end }}", FUNCS)
    [outer] = tree.root
    assert isinstance(outer, Branch) and outer.kind == "if"
    [inner] = outer.orelse
    assert isinstance(inner, Branch) and inner.kind == "if"
    assert inner.pipe.cmds[0].args == [Field(inner.pipe.cmds[0].args[0].pos, ["B"])]


def test_field_chains_end_at_whitespace():
    [action] = parse("{{ index .A.B .C }}", FUNCS).root
    _, chain, single = action.pipe.cmds[0].args
    assert chain.names == ["A", "B"] and single.names == ["C"]
