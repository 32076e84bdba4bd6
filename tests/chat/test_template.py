"""Telling Go templates from Jinja ones, rendering either, and what each says it supports."""

from __future__ import annotations

import pytest

from freetoken.chat import template
from freetoken.chat.errors import TemplateError
from freetoken.tools import synth
from tests.chat.test_gotemplate import CHATML, LEGACY, LLAMA3, MISTRAL, TYPESCRIPT

# In the style of Hugging Face tokenizer_config.json templates.
JINJA_LLAMA = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)
JINJA_THINK = "{% if enable_thinking %}<think>{% endif %}{{ messages[-1].content }}"
# a template that takes a level, as Harmony templates do
JINJA_LEVEL = (
    "{{ messages[-1].content }}|{{ reasoning_effort | default('unset') }}"
    "|{{ enable_thinking | default('unset') }}"
)

GO_TEMPLATES = [
    CHATML,
    LLAMA3,
    LEGACY,
    MISTRAL,
    TYPESCRIPT,
    "{{ .Prompt }}",
    "{{- range .Messages }}{{ .Content }}{{ end }}",
    "{{ if .System }}{{ .System }}{{ end }}",
    "{{/* a comment */}}{{ .Prompt }}",
    '{{ define "x" }}{{ . }}{{ end }}{{ template "x" .Prompt }}',
    "{{ $x := 1 }}{{ $x }}",
    "{{ range .Messages }}",  # broken, but Go: its error should be Go's
    "Just text, no actions",
    '{{ printf "%s" "x" }}',
]
JINJA_TEMPLATES = [
    synth.CHAT_TEMPLATE,
    JINJA_LLAMA,
    JINJA_THINK,
    "{{ messages }}",
    "{{ bos_token }}{{ messages[0]['content'] }}",
    "{{ messages | length }}",
    "{# a comment #}{{ messages[0].content }}",
    "{{ range(3) | list }}",
]


@pytest.mark.parametrize("source", GO_TEMPLATES)
def test_go_templates_are_recognised(source):
    assert template.is_go_template(source)


@pytest.mark.parametrize("source", JINJA_TEMPLATES)
def test_jinja_templates_are_recognised(source):
    assert not template.is_go_template(source)


def test_render_any_renders_either_kind():
    msgs = [{"role": "user", "content": " hi "}]
    assert (
        template.render_any(CHATML, msgs)
        == "<|im_start|>user\n hi <|im_end|>\n<|im_start|>assistant\n"
    )
    assert template.render_any(JINJA_LLAMA, msgs, bos_token="<s>") == (
        "<s><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert template.render_any(JINJA_THINK, msgs, think="high") == "<think> hi "
    assert template.render_any("{{ .Prompt }}|{{ .Suffix }}", msgs, prompt="a", suffix="b") == "a|b"


def test_a_broken_go_template_reports_the_go_error():
    with pytest.raises(TemplateError, match=r"line 1, column 1: unclosed \{\{ range \}\}"):
        template.render_any("{{ range .Messages }}", [{"role": "user", "content": "q"}])


@pytest.mark.parametrize(
    "source, caps",
    [
        (None, ["completion"]),
        ("{{ .Prompt }}", ["completion"]),
        ("Use tools and <think> wisely: {{ .Prompt }}", ["completion"]),  # text is not a read
        (CHATML, ["completion", "tools"]),
        (MISTRAL, ["completion", "tools"]),
        (TYPESCRIPT, ["completion", "tools", "thinking"]),
        ("{{ range .Messages }}{{ .Thinking }}{{ end }}", ["completion", "thinking"]),
        ("{{ range .Messages }}{{ $.Tools }}{{ end }}", ["completion", "tools"]),
        ("<PRE> {{ .Prompt }} <SUF>{{ .Suffix }} <MID>", ["completion", "insert"]),
        ("{{ range .Tools }}", ["completion"]),  # a broken template supports nothing
        (synth.CHAT_TEMPLATE, ["completion", "tools"]),
        (JINJA_THINK, ["completion", "thinking"]),
        (JINJA_LEVEL, ["completion", "thinking"]),
        (JINJA_LLAMA, ["completion"]),
    ],
)
def test_capabilities(source, caps):
    assert template.capabilities(source) == caps


@pytest.mark.parametrize(
    "think, shown",
    [
        (None, "unset|unset"),
        (True, "unset|True"),
        (False, "unset|False"),
        ("low", "low|True"),
        ("medium", "medium|True"),
        ("high", "high|True"),
        ("max", "high|True"),  # templates know low, medium and high
    ],
)
def test_a_think_level_reaches_a_jinja_template(think, shown):
    msgs = [{"role": "user", "content": "q"}]
    assert template.render_any(JINJA_LEVEL, msgs, think=think) == f"q|{shown}"


def test_variables_stand_in_for_the_think_setting():
    msgs = [{"role": "user", "content": "q"}]
    out = template.render_any(JINJA_LEVEL, msgs, think="low", variables={"reasoning_effort": "x"})
    assert out == "q|x|unset"
