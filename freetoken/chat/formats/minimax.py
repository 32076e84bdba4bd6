"""MiniMax-M2: thinking between `<think>` and `</think>`; tool calls as

    <minimax:tool_call>
    <invoke name="NAME">
    <parameter name="P">V</parameter>
    </invoke>
    …</minimax:tool_call>

with any number of invokes (parallel calls) in one section. A value is JSON where the
tool's schema says the parameter is not a string and it parses as JSON, else the text.

A call's grammar writes string values as bare text up to `</parameter>` and the others as
JSON of their schema, one parameter per argument in the schema's order.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from freetoken.chat.formats.markup import DelimitedFormat
from freetoken.chat.formats.scan import (
    call_event,
    open_object,
    parameter_schema,
    typed_value,
    without,
)
from freetoken.chat.grammar import Lark, invoke_section

__all__ = ["MiniMaxFormat"]

_NAME = r"""name\s*=\s*(?:"([^"]*)"|'([^']*)'|([^\s>]+))"""
_INVOKE = re.compile(r"\s+" + _NAME + r"\s*>(.*)", re.S)
_PARAM = re.compile(r"\s*<parameter\s+" + _NAME + r"\s*>(.*?)</parameter>", re.S)
_TAG = re.compile(r"</?(?:invoke|parameter)\b[^>]*>")


@dataclass(frozen=True)
class MiniMaxFormat(DelimitedFormat):
    think_open: str | None = "<think>"
    think_close: str | None = "</think>"
    call_open: str | None = "<minimax:tool_call>"

    name: ClassVar[str] = "minimax"
    markers: ClassVar[tuple[str, ...]] = (
        "<minimax:tool_call>",
        "</minimax:tool_call>",
        "<think>",
        "</think>",
    )
    call_begin: ClassVar[str | None] = "<invoke"
    call_end: ClassVar[str] = "</invoke>"
    call_close: ClassVar[str] = "</minimax:tool_call>"

    def parse_call(self, text: str, schemas: Mapping[str, Any]) -> dict[str, Any] | None:
        m = _INVOKE.match(text)
        if m is None:
            return None
        name = next(g for g in m.groups()[:3] if g is not None)
        body, pos, args = m.group(4), 0, {}
        while p := _PARAM.match(body, pos):
            key = next(g for g in p.groups()[:3] if g is not None)
            args[key] = typed_value(p.group(4), parameter_schema(schemas, name, key))
            pos = p.end()
        if not name or body[pos:].strip():
            return None
        return call_event(name, args)

    def partial_call(self, text: str) -> tuple[str, str]:
        m = _INVOKE.match(text)
        if m is None:
            return "", ""
        body, pos, args = m.group(4), 0, {}
        while p := _PARAM.match(body, pos):
            args[next(g for g in p.groups()[:3] if g is not None)] = p.group(4)
            pos = p.end()
        return next(g for g in m.groups()[:3] if g is not None), open_object(args)

    def readable(self, text: str) -> str:
        return without(_TAG.sub(" ", text), self.markers)

    def call_rules(
        self, lark: Lark, tools: list[dict[str, Any]], lenient: bool, parallel: bool
    ) -> str:
        def pair(key: str, value: str, text: bool) -> str:
            return f'"<parameter name=\\"" {key} "\\">" {value} "\\n"?'

        return invoke_section(
            lark,
            tools,
            head=lambda name: f'<invoke name="{name}">',
            pair=pair,
            close=("</parameter>", self.call_end, self.call_close),
            lenient=lenient,
            parallel=parallel,
        )
