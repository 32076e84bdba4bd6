"""Ollama's rendering rule for Go templates, the data templates see, and templates in the
style of the common model families rendered for a chat with a system prompt, tools, a tool
call and its result. Expected prompts are written out by hand."""

from __future__ import annotations

import datetime

import pytest

from freetoken.chat import gotemplate
from freetoken.chat.errors import TemplateError

SYSTEM = "You are a helpful assistant."
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name", "minLength": 1},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    }
]
# As Ollama re-encodes it: its own key order (required before properties), unknown keys
# (minLength) dropped, compact.
TOOL_JSON = (
    '{"type":"function","function":{"name":"get_weather","description":"Current weather '
    'for a city","parameters":{"type":"object","required":["city"],"properties":{"city":'
    '{"type":"string","description":"City name"},"unit":{"type":"string","enum":'
    '["celsius","fahrenheit"]}}}}}'
)
CHAT = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "What's the weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "thinking": "I should look it up.",
        "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}
        ],
    },
    {"role": "tool", "content": "18°C and sunny", "tool_name": "get_weather"},
    {"role": "assistant", "content": "It is 18°C and sunny in Paris."},
    {"role": "user", "content": "And in Tokyo?"},
]


def user(c: str) -> dict:
    return {"role": "user", "content": c}


def assistant(c: str) -> dict:
    return {"role": "assistant", "content": c}


def system(c: str) -> dict:
    return {"role": "system", "content": c}


# --- the rule: .Messages once, or legacy turn by turn ----------------------------------


def test_a_template_reading_messages_runs_once():
    src = "{{ range .Messages }}[{{ .Role }}:{{ .Content }}]{{ end }}<{{ .Response }}>"
    assert (
        gotemplate.render(src, [user("a"), assistant("b"), user("c")])
        == "[user:a][assistant:b][user:c]<>"
    )


def test_legacy_runs_per_turn_and_cuts_the_last_after_response():
    src = "{{ if .System }}S:{{ .System }}\n{{ end }}U:{{ .Prompt }}\nA:{{ .Response }}<eos>\n"
    chat = [system("s1"), user("q1"), assistant("a1"), user("q2")]
    assert gotemplate.render(src, chat) == "S:s1\nU:q1\nA:a1<eos>\nU:q2\nA:"


def test_legacy_cut_inside_a_block_keeps_its_condition():
    src = "U:{{ .Prompt }}\nA:{{ if true }}{{ .Response }}<eos>{{ else }}never{{ end }}\n"
    assert (
        gotemplate.render(src, [user("q1"), assistant("a1"), user("q2")])
        == "U:q1\nA:a1<eos>\nU:q2\nA:"
    )


def test_legacy_without_response_gets_it_appended():
    # as Ollama does, so that earlier answers are part of the prompt
    assert (
        gotemplate.render("<{{ .Prompt }}>", [user("q1"), assistant("a1"), user("q2")])
        == "<q1>a1<q2>"
    )


def test_legacy_system_after_a_prompt_starts_a_new_turn():
    src = "{{ if .System }}S:{{ .System }}\n{{ end }}U:{{ .Prompt }}\nA:{{ .Response }}\n"
    assert (
        gotemplate.render(src, [system("s1"), user("q1"), system("s2"), user("q2")])
        == "S:s1\nU:q1\nA:\nS:s2\nU:q2\nA:"
    )


def test_legacy_with_a_started_answer_continues_it():
    src = "[INST] {{ .Prompt }}[/INST] {{ .Response }}</s>"
    chat = [user("q1"), assistant("a1"), user("q2"), assistant("My name is")]
    assert gotemplate.render(src, chat) == "[INST] q1[/INST] a1</s>[INST] q2[/INST] My name is"


def test_messages_are_collated_as_ollama_does():
    src = "{{ .System }}|{{ range .Messages }}{{ .Role }}={{ .Content }};{{ end }}"
    chat = [
        system("a"),
        user("x"),
        user("y"),
        {"role": "tool", "content": "t1"},
        {"role": "tool", "content": "t2"},
        system("b"),
    ]
    assert gotemplate.render(src, chat) == "a\n\nb|system=a;user=x\n\ny;tool=t1;tool=t2;system=b;"


def _call(name: str) -> dict:
    return {"function": {"name": name, "arguments": {}}}


def test_merged_assistant_messages_keep_every_tool_call():
    src = "{{ range .Messages }}{{ range .ToolCalls }}{{ .Function.Name }};{{ end }}{{ end }}"
    chat = [
        user("q"),
        {"role": "assistant", "content": "", "tool_calls": [_call("a")]},
        {"role": "assistant", "content": "", "tool_calls": [_call("b")]},
    ]
    assert gotemplate.render(src, chat) == "a;b;"


FIM = "{{ if .Suffix }}<PRE> {{ .Prompt }} <SUF>{{ .Suffix }} <MID>{{ else }}{{ .Prompt }}{{ end }}"


def test_prompt_and_suffix_fill_in_the_middle():
    assert (
        gotemplate.render(FIM, [user("def add(")], prompt="def add(", suffix="return x")
        == "<PRE> def add( <SUF>return x <MID>"
    )
    assert gotemplate.render(FIM, [user("hello")]) == "hello"


def test_a_generate_prompt_is_also_dot_prompt():
    src = "{{ range .Messages }}{{ .Content }}{{ end }}|{{ .Prompt }}"
    assert gotemplate.render(src, [user("hi")], prompt="hi") == "hi|hi"


@pytest.mark.parametrize(
    "think, shown",
    [
        (None, "false||false"),
        (True, "true|medium|true"),
        (False, "false||true"),
        ("low", "true|low|true"),
        ("max", "true|high|true"),
    ],
)
def test_think_values(think, shown):
    src = "{{ range .Messages }}{{ end }}{{ .Think }}|{{ .ThinkLevel }}|{{ .IsThinkSet }}"
    assert gotemplate.render(src, [user("q")], think=think) == shown


# --- what messages and tools look like to a template ----------------------------------


def test_message_fields():
    src = (
        "{{ range .Messages }}{{ .Role }}|{{ .Thinking }}|{{ .ToolName }}|{{ .ToolCallID }}|"
        "{{ range .ToolCalls }}{{ .ID }}#{{ .Function.Index }}:{{ .Function.Name }}"
        "{{ .Function.Arguments }}"
        "{{ range $k, $v := .Function.Arguments }} {{ $k }}={{ $v }}{{ end }}"
        "{{ end }};{{ end }}"
    )
    chat = [
        {
            "role": "assistant",
            "content": "",
            "thinking": "hm",
            "tool_calls": [
                {"id": "call_1", "function": {"name": "f", "arguments": {"z": 1, "a": "x"}}},
                {"function": {"index": 5, "name": "g", "arguments": '{"q": [1, 2]}'}},
            ],
        },
        {"role": "tool", "content": "r", "tool_name": "f", "tool_call_id": "call_1"},
    ]
    assert gotemplate.render(src, chat) == (
        'assistant|hm|||call_1#0:f{"z":1,"a":"x"} a=x z=1#5:g{"q":[1,2]} q=[1 2];tool||f|call_1|;'
    )


def test_tool_fields_and_printing():
    src = (
        "{{ range .Messages }}{{ end }}{{ range .Tools }}{{ .Type }} {{ .Function.Name }}: "
        "{{ .Function.Description }} ({{ .Function.Parameters.Type }}, "
        "required {{ .Function.Parameters.Required }})"
        "{{ range $n, $p := .Function.Parameters.Properties }} {{ $n }}:{{ $p.Type }}"
        "{{ with $p.Enum }}{{ . }}{{ end }}{{ end }}\n"
        "{{ . }}\n{{ .Function.Parameters.Properties }}{{ end }}"
    )
    assert gotemplate.render(src, [user("q")], tools=TOOLS) == (
        "function get_weather: Current weather for a city (object, required [city])"
        " city:string unit:string[celsius fahrenheit]\n" + TOOL_JSON + "\n"
        '{"city":{"type":"string","description":"City name"},'
        '"unit":{"type":"string","enum":["celsius","fahrenheit"]}}'
    )


def test_no_tools_reads_as_false():
    assert (
        gotemplate.render(
            "{{ range .Messages }}{{ end }}{{ if .Tools }}T{{ else }}F{{ end }}{{ len .Tools }}",
            [user("q")],
        )
        == "F0"
    )


def test_malformed_input_is_a_template_error():
    with pytest.raises(TemplateError, match="each tool needs a function"):
        gotemplate.render("{{ .Messages }}", [user("q")], tools=[{"type": "function"}])
    with pytest.raises(TemplateError, match="each message needs a role"):
        gotemplate.render("{{ .Messages }}", [{"content": "q"}])


def test_identifiers_are_what_ollama_calls_vars():
    tpl = gotemplate.parse(
        '{{ define "t" }}{{ .Suffix }}{{ end }}{{ range $i, $m := .Messages }}'
        "{{ $.Tools }}{{ (index $m.ToolCalls 0).Function }}{{ end }}"
    )
    assert tpl.names >= {"suffix", "messages", "tools", "toolcalls", "function", "$m", "$"}
    assert "$i" not in tpl.names  # declared, never read


# --- templates in the style of the common model families --------------------------------

CHATML = """\
{{- if or .System .Tools }}<|im_start|>system
{{- if .System }}
{{ .System }}
{{- end }}
{{- if .Tools }}

# Tools

You may call one or more functions. Their signatures:
<tools>
{{- range .Tools }}
{{ . }}
{{- end }}
</tools>

To call one, reply with <tool_call>{"name": <name>, "arguments": <object>}</tool_call>
{{- end }}<|im_end|>
{{ end }}
{{- range $i, $m := .Messages }}
{{- $last := eq (len (slice $.Messages $i)) 1 }}
{{- if eq .Role "user" }}<|im_start|>user
{{ .Content }}<|im_end|>
{{ else if eq .Role "assistant" }}<|im_start|>assistant
{{ if .Content }}{{ .Content }}
{{- else if .ToolCalls }}
{{- range .ToolCalls }}<tool_call>
{"name": "{{ .Function.Name }}", "arguments": {{ .Function.Arguments }}}
</tool_call>
{{- end }}
{{- end }}{{ if not $last }}<|im_end|>
{{ end }}
{{- else if eq .Role "tool" }}<|im_start|>user
<tool_response>
{{ .Content }}
</tool_response><|im_end|>
{{ end }}
{{- if and (ne .Role "assistant") $last }}<|im_start|>assistant
{{ end }}
{{- end }}"""


def test_chatml_with_tools():
    assert gotemplate.render(CHATML, CHAT, tools=TOOLS) == (
        "<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n\n"
        "You may call one or more functions. Their signatures:\n"
        "<tools>\n" + TOOL_JSON + "\n</tools>\n\n"
        'To call one, reply with <tool_call>{"name": <name>, "arguments": <object>}</tool_call>'
        "<|im_end|>\n"
        "<|im_start|>user\nWhat's the weather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city":"Paris","unit":"celsius"}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n18°C and sunny\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nIt is 18°C and sunny in Paris.<|im_end|>\n"
        "<|im_start|>user\nAnd in Tokyo?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_chatml_without_tools_or_system():
    assert (
        gotemplate.render(CHATML, [user("hi")])
        == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


LLAMA3 = """\
{{- if or .System .Tools }}<|start_header_id|>system<|end_header_id|>
{{- if .System }}

{{ .System }}
{{- end }}
{{- if .Tools }}

Cutting Knowledge Date: December 2023

You can call these functions. To call one, answer {"name": <name>, "parameters": <arguments>}.
{{- range .Tools }}

{{ json . }}
{{- end }}
{{- end }}<|eot_id|>
{{- end }}
{{- range $i, $_ := .Messages }}
{{- $last := eq (len (slice $.Messages $i)) 1 }}
{{- if eq .Role "user" }}<|start_header_id|>user<|end_header_id|>

{{ .Content }}<|eot_id|>
{{- else if eq .Role "assistant" }}<|start_header_id|>assistant<|end_header_id|>

{{ if .ToolCalls }}
{{- range .ToolCalls -}}
{"name": "{{ .Function.Name }}", "parameters": {{ json .Function.Arguments }}}
{{- end }}
{{- else }}{{ .Content }}
{{- end }}{{ if not $last }}<|eot_id|>{{ end }}
{{- else if eq .Role "tool" }}<|start_header_id|>ipython<|end_header_id|>

{{ .Content }}<|eot_id|>
{{- end }}
{{- if and (ne .Role "assistant") $last }}<|start_header_id|>assistant<|end_header_id|>

{{ end }}
{{- end }}"""


def test_llama3_headers_with_tools():
    assert gotemplate.render(LLAMA3, CHAT, tools=TOOLS) == (
        "<|start_header_id|>system<|end_header_id|>\n\nYou are a helpful assistant.\n\n"
        "Cutting Knowledge Date: December 2023\n\nYou can call these functions. To call one, "
        'answer {"name": <name>, "parameters": <arguments>}.\n\n' + TOOL_JSON + "<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat's the weather in Paris?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
        '{"name": "get_weather", "parameters": {"city":"Paris","unit":"celsius"}}<|eot_id|>'
        "<|start_header_id|>ipython<|end_header_id|>\n\n18°C and sunny<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nIt is 18°C and sunny in Paris.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nAnd in Tokyo?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


LEGACY = """{{ if .System }}{{ .System }}

{{ end }}{{ if .Prompt }}### Instruction:
{{ .Prompt }}

{{ end }}### Response:
{{ .Response }}</s>
"""


def test_legacy_alpaca_style():
    # tools, tool calls and tool results have no place in a legacy template: Ollama drops them
    assert gotemplate.render(LEGACY, CHAT, tools=TOOLS) == (
        "You are a helpful assistant.\n\n### Instruction:\nWhat's the weather in Paris?\n\n"
        "### Response:\nIt is 18°C and sunny in Paris.</s>\n"
        "### Instruction:\nAnd in Tokyo?\n\n### Response:\n"
    )


MISTRAL = """\
{{- range $i, $_ := .Messages }}
{{- $left := len (slice $.Messages $i) }}
{{- if eq .Role "user" }}
{{- if and $.Tools (le $left 2) }}[AVAILABLE_TOOLS] {{ json $.Tools }}[/AVAILABLE_TOOLS]
{{- end }}[INST] {{ if and $.System (eq $left 1) }}{{ $.System }}

{{ end }}{{ .Content }}[/INST]
{{- else if eq .Role "assistant" }}
{{- if .Content }} {{ .Content }}</s>
{{- else if .ToolCalls }}[TOOL_CALLS] [
{{- range .ToolCalls }}{"name": "{{ .Function.Name }}", "arguments": {{ json .Function.Arguments }}}
{{- end }}]</s>
{{- end }}
{{- else if eq .Role "tool" }}[TOOL_RESULTS] {"content": {{ json .Content }}}[/TOOL_RESULTS]
{{- end }}
{{- end }}"""


def test_mistral_inst_with_tools():
    assert gotemplate.render(MISTRAL, CHAT, tools=TOOLS) == (
        "[INST] What's the weather in Paris?[/INST]"
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city":"Paris","unit":"celsius"}}]</s>'
        '[TOOL_RESULTS] {"content": "18°C and sunny"}[/TOOL_RESULTS]'
        " It is 18°C and sunny in Paris.</s>"
        "[AVAILABLE_TOOLS] [" + TOOL_JSON + "][/AVAILABLE_TOOLS]"
        "[INST] You are a helpful assistant.\n\nAnd in Tokyo?[/INST]"
    )


TYPESCRIPT = """\
<|system|>{{ if .System }}{{ .System }}
{{ end }}Today is {{ currentDate }}.
{{- if .Tools }}

# Tools

namespace functions {
{{- range .Tools }}

// {{ .Function.Description }}
type {{ .Function.Name }} = (_: {
{{- $required := .Function.Parameters.Required }}
{{- range $name, $prop := .Function.Parameters.Properties }}
{{- $mark := "?" }}
{{- range $required }}{{ if eq . $name }}{{ $mark = "" }}{{ end }}{{ end }}
{{- if $prop.Description }}
// {{ $prop.Description }}
{{- end }}
{{ $name }}{{ $mark }}: {{ toTypeScriptType $prop }},
{{- end }}
}) => any;
{{- end }}

} // namespace functions
{{- end }}<|end|>
{{- range .Messages }}
{{- if eq .Role "user" }}<|user|>{{ .Content }}<|end|>
{{- else if eq .Role "assistant" }}<|assistant|>
{{- if .Thinking }}<think>{{ .Thinking }}</think>{{ end }}
{{- range .ToolCalls }}<|call|>functions.{{ .Function.Name }} {{ .Function.Arguments }}{{ end }}
{{- .Content }}<|end|>
{{- else if eq .Role "tool" }}<|tool|>functions.{{ .ToolName }}: {{ .Content }}<|end|>
{{- end }}
{{- end }}<|assistant|>
{{- if not .Think }}<think></think>{{ end }}"""


@pytest.mark.parametrize("think, tail", [(None, "<think></think>"), (True, "")])
def test_typescript_tools_and_thinking(think, tail):
    today = datetime.date.today().isoformat()
    assert gotemplate.render(TYPESCRIPT, CHAT, tools=TOOLS, think=think) == (
        f"<|system|>You are a helpful assistant.\nToday is {today}.\n\n# Tools\n\n"
        "namespace functions {\n\n// Current weather for a city\ntype get_weather = (_: {\n"
        "// City name\ncity: string,\nunit?: string,\n}) => any;\n\n} // namespace functions<|end|>"
        "<|user|>What's the weather in Paris?<|end|>"
        "<|assistant|><think>I should look it up.</think>"
        '<|call|>functions.get_weather {"city":"Paris","unit":"celsius"}<|end|>'
        "<|tool|>functions.get_weather: 18°C and sunny<|end|>"
        "<|assistant|>It is 18°C and sunny in Paris.<|end|>"
        "<|user|>And in Tokyo?<|end|><|assistant|>" + tail
    )
