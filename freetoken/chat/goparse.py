"""Go text/template, step 2: tokens to a tree, checked as Go checks it (unknown functions,
undefined variables, `break` outside `range` and unclosed blocks are errors at parse time).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from freetoken.chat.errors import TemplateError
from freetoken.chat.golex import Token, error, lex

__all__ = [
    "Action",
    "Branch",
    "Call",
    "Chain",
    "Cmd",
    "Const",
    "Dot",
    "Field",
    "Func",
    "Jump",
    "Nil",
    "Pipe",
    "Text",
    "Tree",
    "Var",
    "parse",
]


@dataclass(slots=True)
class Text:
    pos: int
    text: str


@dataclass(slots=True)
class Action:
    pos: int
    pipe: Pipe


@dataclass(slots=True)
class Branch:
    """`if`, `with` or `range`; `else if` and `else with` nest in `orelse`."""

    pos: int
    kind: str
    pipe: Pipe
    body: list[Node]
    orelse: list[Node]


@dataclass(slots=True)
class Call:
    """`{{ template "name" pipeline }}`."""

    pos: int
    name: str
    pipe: Pipe | None


@dataclass(slots=True)
class Jump:
    """`{{ break }}` or `{{ continue }}`."""

    pos: int
    kind: str


@dataclass(slots=True)
class Pipe:
    pos: int
    decl: list[str]
    assign: bool  # `$x = ...` sets a variable that exists; `$x := ...` declares one
    cmds: list[Cmd]


@dataclass(slots=True)
class Cmd:
    pos: int
    args: list[Arg]


@dataclass(slots=True)
class Field:
    pos: int
    names: list[str]


@dataclass(slots=True)
class Var:
    pos: int
    name: str
    names: list[str]


@dataclass(slots=True)
class Chain:
    """`(pipeline).Field.Field`."""

    pos: int
    pipe: Pipe
    names: list[str]


@dataclass(slots=True)
class Dot:
    pos: int


@dataclass(slots=True)
class Nil:
    pos: int


@dataclass(slots=True)
class Const:
    pos: int
    value: Any


@dataclass(slots=True)
class Func:
    pos: int
    name: str


Node = Text | Action | Branch | Call | Jump
Arg = Field | Var | Chain | Dot | Nil | Const | Func | Pipe


@dataclass
class Tree:
    source: str
    root: list[Node]
    defines: dict[str, list[Node]] = field(default_factory=dict)


def parse(source: str, funcs: Collection[str]) -> Tree:
    return _Parser(source, funcs).parse()


def _describe(tok: Token) -> str:
    if tok.kind == "eof":
        return "end of template"
    if tok.kind == "close":
        return "}}"
    if tok.kind == "field":
        return f"<.{tok.value}>"
    return f"<{tok.value}>" if tok.kind in ("keyword", "ident", "var") else repr(tok.value)


class _Parser:
    def __init__(self, source: str, funcs: Collection[str]):
        self.src = source
        self.toks = lex(source)
        self.i = 0
        self.funcs = funcs
        self.vars = ["$"]
        self.loops = 0  # open `range` blocks, for break/continue
        self.depth = 0  # open blocks of any kind: `define` only at the top
        self.defines: dict[str, list[Node]] = {}

    def parse(self) -> Tree:
        root, _ = self._list(())
        return Tree(self.src, root, self.defines)

    def _err(self, pos: int, message: str) -> TemplateError:
        return error(self.src, pos, message)

    def _peek(self, k: int = 0) -> Token:
        return self.toks[min(self.i + k, len(self.toks) - 1)]

    def _next(self) -> Token:
        tok = self.toks[self.i]
        self.i = min(self.i + 1, len(self.toks) - 1)
        return tok

    def _expect(self, kind: str, context: str) -> Token:
        tok = self._next()
        if tok.kind != kind:
            raise self._err(tok.pos, f"unexpected {_describe(tok)} in {context}")
        return tok

    def _list(self, stops: tuple[str, ...]) -> tuple[list[Node], Token | None]:
        """Nodes up to `{{ end }}`/`{{ else }}` (if in `stops`; consumed) or the end."""
        nodes: list[Node] = []
        while True:
            tok = self._next()
            if tok.kind == "eof":
                return nodes, None
            if tok.kind == "text":
                nodes.append(Text(tok.pos, tok.value))
                continue
            head = self._peek()
            if head.kind == "keyword" and head.value in ("end", "else"):
                if head.value not in stops:
                    raise self._err(tok.pos, f"unexpected {{{{ {head.value} }}}}")
                self._next()
                return nodes, head
            node = self._action(tok)
            if node is not None:
                nodes.append(node)

    def _action(self, open_tok: Token) -> Node | None:
        head = self._peek()
        word = head.value if head.kind == "keyword" else None
        if word in ("if", "with", "range"):
            return self._control(word, open_tok.pos)
        if word == "template":
            self._next()
            name = self._expect("string", "template clause").value
            pipe = None if self._peek().kind == "close" else self._pipeline("template")
            self._expect("close", "template clause")
            return Call(open_tok.pos, name, pipe)
        if word in ("define", "block"):
            return self._define(word, open_tok.pos)
        if word in ("break", "continue"):
            self._next()
            if not self.loops:
                raise self._err(open_tok.pos, f"{{{{ {word} }}}} outside {{{{ range }}}}")
            self._expect("close", word)
            return Jump(open_tok.pos, word)
        pipe = self._pipeline("command")
        self._expect("close", "command")
        return Action(open_tok.pos, pipe)

    def _control(self, kind: str, pos: int) -> Branch:
        self._next()
        mark = len(self.vars)
        pipe = self._pipeline(kind)
        self._expect("close", kind)
        self.depth += 1
        self.loops += 1 if kind == "range" else 0
        body, stop = self._list(("end", "else"))
        self.loops -= 1 if kind == "range" else 0
        orelse: list[Node] = []
        if stop is None:
            raise self._err(pos, f"unclosed {{{{ {kind} }}}}: missing {{{{ end }}}}")
        nxt = self._peek()
        if stop.value == "else" and kind != "range" and nxt.kind == "keyword" and nxt.value == kind:
            # `{{ else if c }}` is `{{ else }}{{ if c }}...{{ end }}`: the nested block
            # consumes the `{{ end }}` both share.
            orelse = [self._control(kind, nxt.pos)]
        elif stop.value == "else":
            self._expect("close", "else")
            orelse, stop = self._list(("end",))
            if stop is None:
                raise self._err(pos, f"unclosed {{{{ {kind} }}}}: missing {{{{ end }}}}")
            self._expect("close", "end")
        else:
            self._expect("close", "end")
        self.depth -= 1
        del self.vars[mark:]
        return Branch(pos, kind, pipe, body, orelse)

    def _define(self, word: str, pos: int) -> Call | None:
        self._next()
        if word == "define" and self.depth:
            raise self._err(pos, "{{ define }} is only allowed at the top level")
        name = self._expect("string", f"{word} clause").value
        pipe = self._pipeline("block") if word == "block" else None
        self._expect("close", f"{word} clause")
        saved = self.vars, self.loops
        self.vars, self.loops = ["$"], 0
        self.depth += 1
        body, stop = self._list(("end",))
        if stop is None:
            raise self._err(pos, f"unclosed {{{{ {word} }}}}: missing {{{{ end }}}}")
        self._expect("close", "end")
        self.depth -= 1
        self.vars, self.loops = saved
        self.defines[name] = body
        return Call(pos, name, pipe) if word == "block" else None

    def _declarations(self, context: str) -> tuple[list[str], bool]:
        t0, t1 = self._peek(), self._peek(1)
        if t0.kind != "var":
            return [], False
        if t1.kind in ("declare", "assign"):
            names, op = [t0.value], t1
        elif (
            t1.kind == "comma"
            and self._peek(2).kind == "var"
            and self._peek(3).kind in ("declare", "assign")
        ):
            if context != "range":
                raise self._err(t0.pos, f"too many declarations in {context}")
            names, op = [t0.value, self._peek(2).value], self._peek(3)
        else:
            return [], False
        self.i += 2 * len(names)
        for name in names:
            if op.kind == "assign":
                self._use_var(name, t0.pos)
            else:
                self.vars.append(name)
        return names, op.kind == "assign"

    def _pipeline(self, context: str) -> Pipe:
        start = self._peek()
        decl, assign = self._declarations(context)
        cmds: list[Cmd] = []
        while True:
            first = self._peek()
            args: list[Arg] = []
            while self._peek().kind not in ("pipe", "close", "rparen", "eof"):
                args.append(self._operand())
            if not args:
                raise self._err(first.pos, f"missing value for {context}")
            cmds.append(Cmd(first.pos, args))
            if self._peek().kind != "pipe":
                return Pipe(start.pos, decl, assign, cmds)
            self._next()

    def _chain(self) -> list[str]:
        names = []
        while self._peek().kind == "field" and not self._peek().spaced:
            names.append(self._next().value)
        return names

    def _operand(self) -> Arg:
        tok = self._next()
        kind, value = tok.kind, tok.value
        if kind == "field":
            return Field(tok.pos, [value, *self._chain()])
        if kind == "var":
            self._use_var(value, tok.pos)
            return Var(tok.pos, value, self._chain())
        if kind == "dot":
            return Dot(tok.pos)
        if kind in ("string", "number"):
            return Const(tok.pos, value)
        if kind == "keyword" and value in ("true", "false"):
            return Const(tok.pos, value == "true")
        if kind == "keyword" and value == "nil":
            return Nil(tok.pos)
        if kind == "ident":
            if value not in self.funcs:
                raise self._err(tok.pos, f'function "{value}" not defined')
            return Func(tok.pos, value)
        if kind == "lparen":
            pipe = self._pipeline("parenthesized pipeline")
            self._expect("rparen", "parenthesized pipeline")
            names = self._chain()
            return Chain(tok.pos, pipe, names) if names else pipe
        raise self._err(tok.pos, f"unexpected {_describe(tok)} in operand")

    def _use_var(self, name: str, pos: int) -> None:
        if name not in self.vars:
            raise self._err(pos, f'undefined variable "{name}"')
