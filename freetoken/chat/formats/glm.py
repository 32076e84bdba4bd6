"""GLM-4.5 and GLM-4.7: thinking between `<think>` and `</think>`; a tool call as

    <tool_call>NAME
    <arg_key>K</arg_key>
    <arg_value>V</arg_value>
    …</tool_call>

(GLM-4.7 writes no newlines between them). A value is JSON where the tool's schema says
the parameter is not a string and it parses as JSON, else the text as written: the
template writes strings bare and everything else as JSON.

A call's grammar writes string values as bare text up to `</arg_value>` and the others as
JSON of their schema, one pair per parameter in the schema's order; parallel calls are
consecutive `<tool_call>` sections.
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
)
from freetoken.chat.grammar import Lark, lit, tagged_arguments

__all__ = ["GlmFormat"]

_KEY = "<arg_key>"
_PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


@dataclass(frozen=True)
class GlmFormat(DelimitedFormat):
    think_open: str | None = "<think>"
    think_close: str | None = "</think>"
    call_open: str | None = "<tool_call>"

    name: ClassVar[str] = "glm"
    markers: ClassVar[tuple[str, ...]] = (
        "<tool_call>",
        "</tool_call>",
        "<arg_key>",
        "</arg_key>",
        "<arg_value>",
        "</arg_value>",
        "<think>",
        "</think>",
    )
    call_close: ClassVar[str] = "</tool_call>"

    def parse_call(self, text: str, schemas: Mapping[str, Any]) -> dict[str, Any] | None:
        name, key, rest = text.partition(_KEY)
        name = name.strip()
        if not name or "<" in name or "\n" in name:
            return None
        rest, pos, args = key + rest, 0, {}
        while m := _PAIR.match(rest, pos):
            k = m.group(1).strip()
            args[k] = typed_value(m.group(2), parameter_schema(schemas, name, k))
            pos = m.end()
        if rest[pos:].strip():
            return None  # a pair cut short, or text that is no pair
        return call_event(name, args)

    def partial_call(self, text: str) -> tuple[str, str]:
        name, key, rest = text.partition(_KEY)
        args, pos = {}, 0
        while m := _PAIR.match(key + rest, pos):
            args[m.group(1).strip()] = m.group(2)
            pos = m.end()
        return name.strip(), open_object(args)

    def call_rules(
        self, lark: Lark, tools: list[dict[str, Any]], lenient: bool, parallel: bool
    ) -> str:
        def pair(key: str, value: str, text: bool) -> str:
            return f'"<arg_key>" {key} "</arg_key>" "\\n"? "<arg_value>" {value} "\\n"?'

        alts = [
            f'{lit(fn["name"])} "\\n"? {tagged_arguments(lark, fn, pair, "</arg_value>", lenient)}'
            for fn in tools
        ]
        return lark.rule(f"({' | '.join(alts)}) {lit(self.call_close)}")
