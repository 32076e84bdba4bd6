"""Go text/template, step 3: running a parsed tree over data.

Scoping follows Go: `if`, `with` and `range` open a scope that ends at their `{{ end }}`;
`$` is the data the template (or a `{{ template }}` call) was run with; a field of a map
that is missing reads as nil (Ollama runs templates with missingkey=zero).
"""

from __future__ import annotations

from typing import Any

from freetoken.chat.errors import TemplateError
from freetoken.chat.gofuncs import FUNCS, LAZY, CallError
from freetoken.chat.golex import error
from freetoken.chat.goparse import (
    Action,
    Arg,
    Branch,
    Call,
    Chain,
    Cmd,
    Const,
    Dot,
    Field,
    Func,
    Jump,
    Nil,
    Node,
    Pipe,
    Text,
    Tree,
    Var,
)
from freetoken.chat.govalues import Struct, format_v, sorted_items, truth, type_name

__all__ = ["execute"]

_MAX_DEPTH = 100  # nested {{ template }} calls; a template that calls itself must stop
_MISSING = object()  # no value piped in from the previous command


def _arity(low: int, high: int | None) -> str:
    if high is None:
        return f"at least {low}"
    return str(low) if low == high else f"{low} to {high}"


class _Break(Exception):
    pass


class _Continue(Exception):
    pass


def execute(tree: Tree, data: Any, root: list[Node] | None = None) -> str:
    """Runs `root` (default: the tree's own) with `data` as both `.` and `$`."""
    run = _Run(tree)
    run.vars = [["$", data]]
    run.block(tree.root if root is None else root, data)
    return "".join(run.out)


class _Run:
    def __init__(self, tree: Tree):
        self.tree = tree
        self.out: list[str] = []
        self.vars: list[list[Any]] = []
        self.depth = 0

    def _err(self, pos: int, message: str) -> TemplateError:
        return error(self.tree.source, pos, message)

    def block(self, nodes: list[Node], dot: Any) -> None:
        for node in nodes:
            if isinstance(node, Text):
                self.out.append(node.text)
            elif isinstance(node, Action):
                value = self.pipe(node.pipe, dot)
                if not node.pipe.decl:
                    # a missing map key is Go's invalid value, printed as "<no value>"
                    self.out.append("<no value>" if value is None else format_v(value))
            elif isinstance(node, Branch):
                self.branch(node, dot)
            elif isinstance(node, Call):
                self.call(node, dot)
            elif isinstance(node, Jump):
                raise _Break() if node.kind == "break" else _Continue()

    def branch(self, node: Branch, dot: Any) -> None:
        mark = len(self.vars)
        try:
            if node.kind == "range":
                self.range(node, dot)
                return
            value = self.pipe(node.pipe, dot)
            if truth(value):
                self.block(node.body, value if node.kind == "with" else dot)
            else:
                self.block(node.orelse, dot)
        finally:
            del self.vars[mark:]

    def range(self, node: Branch, dot: Any) -> None:
        value = self.commands(node.pipe, dot)
        items = self._items(node, value)
        if not items:
            self.block(node.orelse, dot)
            return
        decl = node.pipe.decl
        for key, elem in items:
            mark = len(self.vars)
            bound = [elem] if len(decl) == 1 else [key, elem]
            for name, v in zip(decl, bound):
                if node.pipe.assign:
                    self._set(name, v)
                else:
                    self.vars.append([name, v])
            try:
                self.block(node.body, elem)
            except _Continue:
                pass
            except _Break:
                break
            finally:
                del self.vars[mark:]

    def _items(self, node: Branch, value: Any) -> list[tuple[Any, Any]]:
        if value is None:
            return []
        if isinstance(value, dict):
            return sorted_items(value)
        if isinstance(value, (list, tuple)):
            return list(enumerate(value))
        if isinstance(value, int) and not isinstance(value, bool):
            if len(node.pipe.decl) > 1:
                raise self._err(node.pos, "can't use two variables to range over an int")
            return [(i, i) for i in range(value)]
        raise self._err(node.pos, f"range can't iterate over {format_v(value)}")

    def call(self, node: Call, dot: Any) -> None:
        body = self.tree.defines.get(node.name)
        if body is None:
            raise self._err(node.pos, f'no such template "{node.name}"')
        if self.depth >= _MAX_DEPTH:
            raise self._err(node.pos, f"exceeded maximum template depth ({_MAX_DEPTH})")
        value = None if node.pipe is None else self.pipe(node.pipe, dot)
        saved, self.vars = self.vars, [["$", value]]
        self.depth += 1
        try:
            self.block(body, value)
        finally:
            self.vars = saved
            self.depth -= 1

    def pipe(self, pipe: Pipe, dot: Any) -> Any:
        value = self.commands(pipe, dot)
        for name in pipe.decl:
            if pipe.assign:
                self._set(name, value)
            else:
                self.vars.append([name, value])
        return value

    def commands(self, pipe: Pipe, dot: Any) -> Any:
        value: Any = _MISSING
        for cmd in pipe.cmds:
            value = self.command(cmd, dot, value)
        return value

    def command(self, cmd: Cmd, dot: Any, final: Any) -> Any:
        first = cmd.args[0]
        if isinstance(first, Func):
            return self.function(first, cmd.args[1:], dot, final)
        if len(cmd.args) > 1 or final is not _MISSING:
            if isinstance(first, (Field, Var, Chain)) and first.names:
                raise self._err(first.pos, f"{first.names[-1]} is not a method but has arguments")
            raise self._err(first.pos, "can't give argument to non-function")
        if isinstance(first, Nil):
            raise self._err(first.pos, "nil is not a command")
        return self.arg(first, dot)

    def arg(self, node: Arg, dot: Any) -> Any:
        if isinstance(node, Field):
            return self.fields(dot, node.names, node.pos)
        if isinstance(node, Var):
            return self.fields(self._get(node.name), node.names, node.pos)
        if isinstance(node, Chain):
            return self.fields(self.pipe(node.pipe, dot), node.names, node.pos)
        if isinstance(node, Pipe):
            return self.pipe(node, dot)
        if isinstance(node, Func):
            return self.function(node, [], dot, _MISSING)
        if isinstance(node, Const):
            return node.value
        return dot if isinstance(node, Dot) else None

    def fields(self, value: Any, names: list[str], pos: int) -> Any:
        for name in names:
            if isinstance(value, Struct):
                if name not in value.fields:
                    raise self._err(pos, f"can't evaluate field {name} in type {value.type_name}")
                value = value.fields[name]
            elif isinstance(value, dict):
                value = value.get(name)
            elif value is None:
                raise self._err(pos, f"nil pointer evaluating interface {{}}.{name}")
            else:
                raise self._err(pos, f"can't evaluate field {name} in type {type_name(value)}")
        return value

    def function(self, node: Func, args: list[Arg], dot: Any, final: Any) -> Any:
        spec = FUNCS[node.name]
        count = len(args) + (final is not _MISSING)
        if count < spec.min_args or (spec.max_args is not None and count > spec.max_args):
            raise self._err(
                node.pos,
                f"wrong number of args for {node.name}: "
                f"want {_arity(spec.min_args, spec.max_args)} got {count}",
            )
        operands = [lambda a=a: self.arg(a, dot) for a in args]
        if final is not _MISSING:
            operands.append(lambda: final)
        if node.name in LAZY:
            # `and` stops at the first false operand and `or` at the first true one, and
            # returns it; the operands after it are never evaluated (Go 1.18+).
            for operand in operands:
                value = operand()
                if truth(value) != (node.name == "and"):
                    break
            return value
        values = [operand() for operand in operands]
        try:
            return spec.fn(*values)
        except CallError as e:
            raise self._err(node.pos, f"error calling {node.name}: {e}") from None

    def _get(self, name: str) -> Any:
        for entry in reversed(self.vars):
            if entry[0] == name:
                return entry[1]
        raise TemplateError(f'template: undefined variable "{name}"')

    def _set(self, name: str, value: Any) -> None:
        for entry in reversed(self.vars):
            if entry[0] == name:
                entry[1] = value
                return
        raise TemplateError(f'template: undefined variable "{name}"')
