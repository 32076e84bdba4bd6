"""What a request asks the output to be: a JSON value (`format`) or a tool call (`tool_choice`).

`format`: "json" means a JSON object (what Ollama's models return for it), a JSON-schema
object means an instance of it.

`tool_choice` (the OpenAI and Anthropic field, passed to the runner as is):
- "auto" (or absent): the model decides, tools are offered as usual, unless the option
  below says otherwise;
- "none": tools are not rendered into the prompt (so not called either);
- "required": the answer is one or more calls (parallel calls) to offered tools, each call's
  arguments an instance of its tool's parameters, in the markup of the model's format
  (chat/formats/, `ChatFormat.call_grammar`), and nothing else;
- {"type": "function", "function": {"name": N}}: the same, calls to tool N.

Under "auto" the answer is free text, but a call the model opens follows the same grammar
from its opening marker on (`ChatFormat.auto_grammar`), so it cannot end malformed.

The `tool_choice` option (a Modelfile PARAMETER or request option; a FreeToken extension)
takes the same strings for clients that cannot send the field. As an option, "required"
applies only while the conversation's last message is not a tool result: an agent loop
(OpenCode, OpenClaw) then gets a forced call first and a free answer once the tool has
answered, instead of calling tools forever. A request's "none", "required" or function
overrides the option; its "auto" does not, because SDKs (the AI SDK behind OpenCode, for one)
send "auto" with every request that has tools, so it says nothing about the caller's wish.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from freetoken.chat.grammar import Lark, SchemaError, lit

__all__ = [
    "SchemaError",
    "arguments",
    "forced_tools",
    "json_calls",
    "named_calls",
    "offered_tools",
    "tool_choice",
]

_CHOICES = ("auto", "none", "required")


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


def offered_tools(tools: list[Any] | None) -> list[dict[str, Any]]:
    """The functions among a request's tools (OpenAI's wrapped form or bare)."""
    return [fn for fn in map(_tool_fn, tools or []) if fn is not None]


def forced_tools(tools: list[Any], name: str | None) -> list[dict[str, Any]]:
    """The functions a forced call may call: `name`, or any of `tools`; SchemaError if none."""
    found = [fn for fn in offered_tools(tools) if name in (None, fn["name"])]
    if not found:
        raise SchemaError(
            f'tool "{name}" is not among the tools' if name else "tool_choice needs tools"
        )
    return found


def arguments(lark: Lark, fn: dict[str, Any], lenient: bool) -> str:
    """`%json` of a tool's arguments: an object of its parameters (any object without
    them). A tool marked `strict` is never read leniently."""
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise SchemaError(f'tool "{fn["name"]}": parameters must be a JSON schema object')
    schema = params or {"type": "object"}
    if "type" not in schema and not any(k in schema for k in ("anyOf", "oneOf", "$ref")):
        schema = {**schema, "type": "object"}  # arguments are always an object
    return lark.json(schema, f'tool "{fn["name"]}"', lenient and fn.get("strict") is not True)


def json_calls(lark: Lark, fns: list[dict[str, Any]], lenient: bool) -> str:
    """A rule for one `{"name": ..., "arguments": {...}}` call to one of `fns`."""
    alts = []
    for fn in fns:
        head = lit('{"name": ' + json.dumps(fn["name"], ensure_ascii=False) + ', "arguments": ')
        alts.append(f'{head} {arguments(lark, fn, lenient)} "}}"')
    return lark.rule(" | ".join(alts))


def named_calls(
    lark: Lark,
    fns: list[dict[str, Any]],
    lenient: bool,
    around: Callable[[str], tuple[str, str]],
) -> str:
    """A rule for one call in markup that names the tool: `around(name)` is the Lark text
    before and after its JSON arguments."""
    alts = []
    for fn in fns:
        before, after = around(fn["name"])
        alts.append(f"{before} {arguments(lark, fn, lenient)} {after}")
    return lark.rule(" | ".join(f"({a})" for a in alts))
