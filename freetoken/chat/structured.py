"""What a request asks the output to be: a JSON value (`format`) or a tool call (`tool_choice`).

`format`: "json" means a JSON object (what Ollama's models return for it), a JSON-schema
object means an instance of it.

`tool_choice` (the OpenAI and Anthropic field, passed to the runner as is):
- "auto" (or absent): the model decides, tools are offered as usual, unless the option
  below says otherwise;
- "none": tools are not rendered into the prompt (so not called either);
- "required": the answer is one call to an offered tool, its arguments an instance of
  the tool's parameters, in the markup of the model's format (chat/formats/), and nothing
  else: `<tool_call>{"name": ..., "arguments": ...}</tool_call>` (`tool_call_grammar`; the
  bare JSON object for a template without call markers), or markup that names the tool
  around its JSON arguments (`call_alternatives`). A format whose arguments are not JSON
  has no grammar: its forced calls are not constrained (the format says so,
  `ChatFormat.call_grammar`);
- {"type": "function", "function": {"name": N}}: the same call, to tool N.

The `tool_choice` option (a Modelfile PARAMETER or request option; a FreeToken extension)
takes the same strings for clients that cannot send the field. As an option, "required"
applies only while the conversation's last message is not a tool result: an agent loop
(OpenCode, OpenClaw) then gets a forced call first and a free answer once the tool has
answered, instead of calling tools forever. A request's "none", "required" or function
overrides the option; its "auto" does not, because SDKs (the AI SDK behind OpenCode, for one)
send "auto" with every request that has tools, so it says nothing about the caller's wish.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from freetoken.chat.jsonfsm import Grammar
from freetoken.chat.schema import (
    ANY,
    ANY_OBJECT,
    SchemaError,
    compile_schema,
    literal_node,
    object_node,
    union_node,
)

__all__ = [
    "SchemaError",
    "call_alternatives",
    "forced_tools",
    "format_grammar",
    "tool_call_grammar",
    "tool_choice",
]

_CHOICES = ("auto", "none", "required")


def format_grammar(fmt: Any) -> Grammar:
    """The grammar of a request's `format` ("json" or a JSON schema)."""
    if fmt == "json":
        return Grammar(ANY_OBJECT)
    if isinstance(fmt, dict):
        return Grammar(compile_schema(fmt))
    raise SchemaError('format must be "json" or a JSON schema object')


def _named(choice: dict[str, Any]) -> str:
    fn = choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else choice.get("name")
    if choice.get("type", "function") != "function" or not isinstance(name, str) or not name:
        raise SchemaError(
            'tool_choice must be "auto", "none", "required" or '
            '{"type": "function", "function": {"name": ...}}'
        )
    return name


def tool_choice(
    request_choice: Any,
    option_choice: Any,
    messages: list[dict[str, Any]] | None,
    tools: list[Any] | None,
) -> tuple[str, str | None]:
    """The effective choice as (mode, tool name): mode "auto", "none" or "required"; a
    name when one function is forced.

    The request's field wins unless it is "auto"; else the `tool_choice` option, whose
    "required" lapses when no tools are offered or the last message is a tool result."""
    if request_choice is not None and request_choice != "auto":
        if isinstance(request_choice, dict):
            return "required", _named(request_choice)
        if request_choice not in _CHOICES:
            raise SchemaError(
                f'invalid tool_choice {request_choice!r}: must be "auto", "none", '
                '"required" or a function'
            )
        return request_choice, None
    if option_choice is None:
        return "auto", None
    if option_choice not in _CHOICES:
        raise SchemaError(
            f'invalid tool_choice option {option_choice!r}: must be "auto", "none" or "required"'
        )
    answered = bool(messages) and messages[-1].get("role") == "tool"
    if option_choice == "required" and (not tools or answered):
        return "auto", None
    return option_choice, None


def _tool_fn(tool: Any) -> dict[str, Any] | None:
    if not isinstance(tool, dict):
        return None
    fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool
    return fn if isinstance(fn.get("name"), str) and fn["name"] else None


def forced_tools(tools: list[Any], name: str | None) -> list[dict[str, Any]]:
    """The functions a forced call may call: `name`, or any of `tools`; SchemaError if none."""
    found = [fn for fn in filter(None, map(_tool_fn, tools)) if name in (None, fn["name"])]
    if not found:
        raise SchemaError(
            f'tool "{name}" is not among the tools' if name else "tool_choice needs tools"
        )
    return found


def _arguments(tools: list[Any], name: str | None) -> list[tuple[str, Any]]:
    """(name, arguments node) of each tool a forced call may call."""
    out = []
    for fn in forced_tools(tools, name):
        params = fn.get("parameters")
        try:
            args = compile_schema(params) if params else ANY_OBJECT
        except SchemaError as e:
            raise SchemaError(f'tool "{fn["name"]}": {e}') from None
        out.append((fn["name"], ANY_OBJECT if args is ANY else args))  # always an object
    return out


def tool_call_grammar(
    tools: list[Any], name: str | None, call_open: str | None, call_close: str | None
) -> Grammar:
    """One call to one of `tools` (to `name` when given), as `{"name": ..., "arguments":
    ...}` between the call markers."""
    alts = [
        object_node([("name", literal_node([fn]), True), ("arguments", args, True)], None)
        for fn, args in _arguments(tools, name)
    ]
    return Grammar(union_node(alts), (call_open or "").encode(), (call_close or "").encode())


def call_alternatives(
    tools: list[Any], name: str | None, around: Callable[[str], tuple[str, str]]
) -> Grammar:
    """One call to one of `tools` (to `name` when given) in markup that names the tool:
    `around(tool)` is the text before and after its JSON arguments."""
    alts = []
    for fn, args in _arguments(tools, name):
        before, after = around(fn)
        alts.append(Grammar(args, before.encode(), after.encode()))
    return Grammar(alts[0].node, alts[0].prefix, alts[0].suffix, tuple(alts[1:]))
