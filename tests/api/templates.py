"""Jinja chat templates written for the format tests, each in its family's prompt shape:
tools in the system turn, earlier calls rendered in the family's markup, the generation
prompt the family ends with."""

from __future__ import annotations

DEEPSEEK = (
    "{{ bos_token }}{% if tools %}## Tools\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'user' %}<｜User｜>{{ m.content }}"
    "{% elif m.role == 'assistant' %}<｜Assistant｜>"
    "{% if m.thinking %}<think>{{ m.thinking }}</think>{% endif %}{{ m.content }}"
    "{% if m.tool_calls %}<｜tool▁calls▁begin｜>{% for c in m.tool_calls %}"
    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{{ c.function.name }}\n```json\n"
    "{{ c.function.arguments | tojson }}\n```<｜tool▁call▁end｜>{% endfor %}"
    "<｜tool▁calls▁end｜>{% endif %}<｜end▁of▁sentence｜>"
    "{% elif m.role == 'tool' %}<｜tool▁output▁begin｜>{{ m.content }}<｜tool▁output▁end｜>"
    "{% else %}{{ m.content }}\n{% endif %}{% endfor %}"
    "<｜Assistant｜>"
)

GLM = (
    "[gMASK]<sop>{% if tools %}<|system|>\n# Tools\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}<|assistant|>"
    "{% if m.thinking %}<think>{{ m.thinking }}</think>{% endif %}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}\n"
    "{% for k, v in c.function.arguments.items() %}<arg_key>{{ k }}</arg_key>\n"
    "<arg_value>{{ v if v is string else v | tojson }}</arg_value>\n{% endfor %}"
    "</tool_call>{% endfor %}"
    "{% elif m.role == 'tool' %}<|observation|>\n<tool_response>{{ m.content }}</tool_response>"
    "{% else %}<|{{ m.role }}|>\n{{ m.content }}{% endif %}{% endfor %}"
    "<|assistant|>"
)

MINIMAX = (
    "]~!b[]~b]system\nYou are a helpful assistant."
    "{% if tools %}\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>{% endif %}"
    "[e~[\n"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}]~b]ai\n"
    "{% if m.thinking %}<think>{{ m.thinking }}</think>\n{% endif %}{{ m.content }}"
    "{% if m.tool_calls %}<minimax:tool_call>\n{% for c in m.tool_calls %}"
    '<invoke name="{{ c.function.name }}">\n'
    "{% for k, v in c.function.arguments.items() %}"
    '<parameter name="{{ k }}">{{ v if v is string else v | tojson }}</parameter>\n'
    "{% endfor %}</invoke>\n{% endfor %}</minimax:tool_call>{% endif %}[e~[\n"
    "{% elif m.role == 'tool' %}]~b]tool\n<response>{{ m.content }}</response>[e~[\n"
    "{% else %}]~b]{{ m.role }}\n{{ m.content }}[e~[\n{% endif %}{% endfor %}"
    # in an expression: Jinja drops a template's own last newline
    "{{ ']~b]ai\\n<think>\\n' }}"
)

# DeepSeek-V4's turn shape with its DSML calls: strings marked string="true" and written
# bare, every other value JSON
DSML = (
    "{{ bos_token }}{% if tools %}## Tools\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'user' %}<｜User｜>{{ m.content }}"
    "{% elif m.role == 'assistant' %}<｜Assistant｜>"
    "{% if m.thinking %}<think>{{ m.thinking }}</think>{% endif %}{{ m.content }}"
    "{% if m.tool_calls %}\n\n<｜DSML｜tool_calls>\n{% for c in m.tool_calls %}"
    '<｜DSML｜invoke name="{{ c.function.name }}">\n'
    "{% for k, v in c.function.arguments.items() %}"
    '<｜DSML｜parameter name="{{ k }}" string="{{ "true" if v is string else "false" }}">'
    "{{ v if v is string else v | tojson }}</｜DSML｜parameter>\n"
    "{% endfor %}</｜DSML｜invoke>\n{% endfor %}</｜DSML｜tool_calls>{% endif %}"
    "<｜end▁of▁sentence｜>"
    "{% elif m.role == 'tool' %}<｜User｜><tool_result>{{ m.content }}</tool_result>"
    "{% endif %}{% endfor %}<｜Assistant｜>"
)

MISTRAL = (
    "<s>{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'user' %}[INST]{{ m.content }}[/INST]"
    "{% elif m.role == 'assistant' %}{{ m.content }}"
    "{% for c in m.tool_calls or [] %}[TOOL_CALLS]{{ c.function.name }}[ARGS]"
    "{{ c.function.arguments | tojson }}{% endfor %}</s>"
    "{% elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]"
    "{% else %}[SYSTEM_PROMPT]{{ m.content }}[/SYSTEM_PROMPT]{% endif %}{% endfor %}"
)

HARMONY = (
    "<|start|>system<|message|>You are a helpful assistant.\n"
    "Reasoning: {{ reasoning_effort | default('medium') }}\n\n"
    "# Valid channels: analysis, commentary, final.<|end|>"
    "{% if tools %}<|start|>developer<|message|># Tools\n\nnamespace functions {\n"
    "{% for t in tools %}type {{ t.function.name }} = (_: {{ t.function.parameters | tojson }})"
    " => any;\n{% endfor %}}<|end|>{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}"
    "{% if m.thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}"
    "<|end|>{% endif %}"
    "{% for c in m.tool_calls or [] %}<|start|>assistant<|channel|>commentary "
    "to=functions.{{ c.function.name }} <|constrain|>json<|message|>"
    "{{ c.function.arguments | tojson }}<|call|>{% endfor %}"
    "{% if m.content %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}"
    "<|end|>{% endif %}"
    "{% elif m.role == 'tool' %}<|start|>functions.{{ m.tool_name }} to=assistant"
    "<|channel|>commentary<|message|>{{ m.content }}<|end|>"
    "{% else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}{% endfor %}"
    "<|start|>assistant"
)

# prints the think setting it was given as its last token
LEVELS = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n<effort_"
    "{%- if reasoning_effort is defined %}{{ reasoning_effort }}"
    "{%- elif enable_thinking is defined %}{{ 'on' if enable_thinking else 'off' }}"
    "{%- else %}unset{% endif %}>"
)

GRANITE = (
    "{% if tools %}<|start_of_role|>available_tools<|end_of_role|>{{ tools | tojson }}"
    "<|end_of_text|>\n{% endif %}{% for m in messages %}"
    "{% if m.tool_calls %}<|start_of_role|>assistant<|end_of_role|>{{ m.content }}<|tool_call|>"
    "{{ m.tool_calls | map(attribute='function') | list | tojson }}<|end_of_text|>\n"
    "{% elif m.role == 'tool' %}<|start_of_role|>tool_response<|end_of_role|>{{ m.content }}"
    "<|end_of_text|>\n{% else %}<|start_of_role|>{{ m.role }}<|end_of_role|>{{ m.content }}"
    "<|end_of_text|>\n{% endif %}{% endfor %}<|start_of_role|>assistant<|end_of_role|>"
)
