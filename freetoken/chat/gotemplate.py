"""Ollama Modelfile TEMPLATEs: Go text/template, rendered for a conversation as Ollama does.

Ollama's rule: a template that reads `.Messages` runs once over the whole conversation.
Any other template is "legacy": it runs once per turn with `.System`, `.Prompt` and
`.Response`, the turns are concatenated, and the last turn is cut right after `.Response`,
where the model's answer begins. A generate request with a suffix (fill in the middle)
runs it once with `.Prompt` and `.Suffix`.

The interpreter itself is golex (tokens), goparse (tree), goeval (running it), gofuncs and
govalues (functions and Go's printing rules).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from freetoken.chat import goparse
from freetoken.chat.errors import TemplateError
from freetoken.chat.goeval import execute
from freetoken.chat.gofuncs import FUNCS
from freetoken.chat.goparse import Action, Branch, Call, Chain, Cmd, Field, Node, Pipe, Tree, Var
from freetoken.chat.govalues import JSONList, JSONMap, Struct

__all__ = ["GoTemplate", "identifiers", "parse", "render"]


@dataclass(frozen=True)
class GoTemplate:
    tree: Tree
    names: frozenset[str]  # every field and variable name it reads, lower-cased
    last_turn: list[Node]  # for legacy rendering: the template cut right after `.Response`

    def execute(self, data: Any, last_turn: bool = False) -> str:
        return execute(self.tree, data, self.last_turn if last_turn else None)


@lru_cache(maxsize=32)
def parse(source: str) -> GoTemplate:
    tree = goparse.parse(source, FUNCS)
    names = identifiers(tree)
    if "messages" not in names and "response" not in names:
        # As Ollama does, so that earlier answers still appear in a legacy prompt.
        end = len(source)
        tree.root.append(Action(end, Pipe(end, [], False, [Cmd(end, [Field(end, ["Response"])])])))
    return GoTemplate(tree, frozenset(names), _cut_after(tree.root, "Response"))


def identifiers(tree: Tree) -> set[str]:
    """Field and variable names the template reads anywhere, lower-cased (Ollama's Vars)."""
    names: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, (Field, Var, Chain)):
            names.update(n.lower() for n in node.names)
        if isinstance(node, Var):
            names.add(node.name.lower())
        if isinstance(node, (Action, Call, Chain)):
            visit(node.pipe)
        elif isinstance(node, Branch):
            visit(node.pipe)
            for child in node.body + node.orelse:
                visit(child)
        elif isinstance(node, Pipe):
            for cmd in node.cmds:
                for arg in cmd.args:
                    visit(arg)

    for node in tree.root + [n for body in tree.defines.values() for n in body]:
        visit(node)
    return names


def _reads(node: Any, name: str) -> bool:
    if isinstance(node, Field) or (isinstance(node, Var) and node.name == "$"):
        return name in node.names
    if isinstance(node, (Chain, Pipe)):
        pipe = node.pipe if isinstance(node, Chain) else node
        return any(_reads(arg, name) for cmd in pipe.cmds for arg in cmd.args)
    return False


def _cut_after(nodes: list[Node], name: str) -> list[Node]:
    """The nodes up to and including the first action that prints field `name`; blocks
    that hold it keep their condition and are cut inside (Ollama's rule for the last turn)."""
    found = False

    def walk(nodes: list[Node]) -> list[Node]:
        nonlocal found
        out: list[Node] = []
        for node in nodes:
            if found:
                break
            if isinstance(node, Action):
                found = _reads(node.pipe, name)
                out.append(node)
            elif isinstance(node, Branch):
                body, orelse = walk(node.body), walk(node.orelse)
                out.append(Branch(node.pos, node.kind, node.pipe, body, orelse))
            else:
                out.append(node)
        return out

    cut = walk(nodes)
    return cut if found else list(nodes)


def render(
    source: str,
    messages: list[dict[str, Any]],
    *,
    tools: list[Any] | None = None,
    think: bool | str | None = None,
    prompt: str | None = None,
    suffix: str | None = None,
) -> str:
    """The prompt Ollama renders from a Go template for this conversation."""
    tpl = parse(source)
    data: dict[str, Any] = {
        "System": "",
        "Prompt": prompt or "",
        "Response": "",
        "Suffix": suffix or "",
        "Messages": [],
        "Tools": JSONList(),
        **_think(think),
    }
    if prompt and suffix:
        return tpl.execute(data)
    system, turns = _collate(messages)
    if "messages" in tpl.names:
        data.update(
            System=system,
            Messages=[_message(m) for m in turns],
            Tools=JSONList(_tool(t) for t in tools or []),
        )
        return tpl.execute(data)
    return _legacy(tpl, turns, data)


def _legacy(tpl: GoTemplate, turns: list[dict[str, Any]], data: dict[str, Any]) -> str:
    out: list[str] = []
    turn = {"System": "", "Prompt": "", "Response": ""}
    for m in turns:
        role, content = m["role"], m.get("content") or ""
        # A turn is complete when the next one starts: a system message after a prompt or
        # answer, or a user message after an answer. Other roles have no place here.
        if (role == "system" and (turn["Prompt"] or turn["Response"])) or (
            role == "user" and turn["Response"]
        ):
            out.append(tpl.execute({**data, **turn}))
            turn = {"System": "", "Prompt": "", "Response": ""}
        key = {"system": "System", "user": "Prompt", "assistant": "Response"}.get(role)
        if key:
            turn[key] = content
    out.append(tpl.execute({**data, **turn}, last_turn=True))
    return "".join(out)


def _collate(messages: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """All system texts joined, and the messages with consecutive ones of a role merged
    (tool results stay apart), as Ollama hands them to templates."""
    system: list[str] = []
    turns: list[dict[str, Any]] = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise TemplateError("template: each message needs a role")
        if m["role"] == "system":
            system.append(m.get("content") or "")
        last = turns[-1] if turns else None
        if last and last["role"] == m["role"] and m["role"] != "tool":
            # Unlike Ollama, the tool calls of both messages are kept, not only the first's.
            content = f"{last.get('content') or ''}\n\n{m.get('content') or ''}"
            calls = [*(last.get("tool_calls") or []), *(m.get("tool_calls") or [])]
            turns[-1] = {**last, "content": content, "tool_calls": calls}
        else:
            turns.append(m)
    return "\n\n".join(system), turns


def _think(think: bool | str | None) -> dict[str, Any]:
    if isinstance(think, str):
        level = "high" if think == "max" else think
    else:
        level = "medium" if think else ""
    return {"Think": bool(level), "ThinkLevel": level, "IsThinkSet": think is not None}


def _message(m: dict[str, Any]) -> Struct:
    calls = [_tool_call(c, i) for i, c in enumerate(m.get("tool_calls") or [])]
    return Struct(
        "Message",
        {
            "Role": m["role"],
            "Content": m.get("content") or "",
            "Thinking": m.get("thinking") or "",
            "Images": list(m.get("images") or []),
            "ToolCalls": calls,
            "ToolName": m.get("tool_name") or "",
            "ToolCallID": m.get("tool_call_id") or "",
        },
    )


def _tool_call(call: Any, index: int) -> Struct:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict):
        raise TemplateError("template: each tool call needs a function")
    args = fn.get("arguments")
    if isinstance(args, str):  # OpenAI-style clients send the arguments as JSON text
        try:
            args = json.loads(args)
        except ValueError:
            pass
    fields = {
        "Index": fn.get("index", index),
        "Name": fn.get("name") or "",
        "Arguments": JSONMap(args) if isinstance(args, dict) else args or JSONMap(),
    }
    return Struct(
        "ToolCall", {"ID": call.get("id") or "", "Function": Struct("ToolCallFunction", fields)}
    )


def _tool(tool: Any) -> Struct:
    """A tool as Ollama's template types hold it; it prints as the JSON Ollama re-encodes
    (its known keys, in its own order, empty optional ones left out)."""
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(fn, dict):
        raise TemplateError("template: each tool needs a function")
    params = _parameters(fn.get("parameters"))
    fn_wire = {
        "name": fn.get("name") or "",
        "description": fn.get("description") or "",
        "parameters": params.wire,
    }
    wire: dict[str, Any] = {"type": tool.get("type") or ""}
    if tool.get("items"):
        wire["items"] = tool["items"]
    wire["function"] = fn_wire
    function = Struct(
        "ToolFunction",
        {
            "Name": fn_wire["name"],
            "Description": fn_wire["description"],
            "Parameters": params,
        },
        fn_wire,
    )
    return Struct(
        "Tool", {"Type": wire["type"], "Items": tool.get("items"), "Function": function}, wire
    )


def _parameters(params: Any) -> Struct:
    params = params if isinstance(params, dict) else {}
    props = _properties(params.get("properties"))
    wire: dict[str, Any] = {"type": params.get("type") or ""}
    for key in ("$defs", "items", "required"):
        if params.get(key):
            wire[key] = params[key]
    wire["properties"] = None if props is None else {k: p.wire for k, p in props.items()}
    return Struct(
        "ToolFunctionParameters",
        {
            "Type": wire["type"],
            "Defs": params.get("$defs"),
            "Items": params.get("items"),
            "Required": list(params.get("required") or []),
            "Properties": props,
        },
        wire,
    )


def _properties(props: Any) -> JSONMap | None:
    if not isinstance(props, dict):
        return None
    return JSONMap((name, _property(p)) for name, p in props.items())


def _property(p: Any) -> Struct:
    p = p if isinstance(p, dict) else {}
    types = p.get("type")
    types = [types] if isinstance(types, str) else list(types or [])
    kind = types[0] if len(types) == 1 else (types or "")  # Go's PropertyType prints this way
    any_of = [_property(x) for x in p.get("anyOf") or []]
    nested = _properties(p.get("properties"))
    wire: dict[str, Any] = {}
    if any_of:
        wire["anyOf"] = [x.wire for x in any_of]
    if types:
        wire["type"] = kind
    for key in ("items", "description", "enum"):
        if p.get(key):
            wire[key] = p[key]
    if nested is not None:
        wire["properties"] = {k: v.wire for k, v in nested.items()}
    if p.get("required"):
        wire["required"] = p["required"]
    return Struct(
        "ToolProperty",
        {
            "AnyOf": any_of,
            "Type": kind,
            "Items": p.get("items"),
            "Description": p.get("description") or "",
            "Enum": list(p.get("enum") or []),
            "Properties": nested,
            "Required": list(p.get("required") or []),
        },
        wire,
    )
