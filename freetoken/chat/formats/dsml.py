"""DeepSeek-V4 (DSML): thinking between `<think>` and `</think>`; tool calls as

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="P" string="true">V</｜DSML｜parameter>
    </｜DSML｜invoke>
    …</｜DSML｜tool_calls>

with any number of invokes (parallel calls) in one section. Each parameter says how its
value is written: `string="true"` is the text as it stands, `string="false"` is JSON. A
value marked JSON that does not parse is read as the tool's schema says (text for a
string parameter), so a slip of the model still yields the call it meant.

A call's grammar writes string values as bare text up to the parameter's close, marked
`string="true"`, and the others as JSON of their schema, marked `string="false"`, one
parameter per argument in the schema's order.
"""

from __future__ import annotations

import json
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

__all__ = ["DsmlFormat"]

_D = "｜DSML｜"
_Q = r"""(?:"([^"]*)"|'([^']*)'|([^\s>]+))"""  # an attribute's value, quoted or not
_INVOKE = re.compile(r"\s+name\s*=\s*" + _Q + r"\s*>(.*)", re.S)
_PARAM = re.compile(
    r"\s*<" + _D + r"parameter\s+name\s*=\s*" + _Q + r"(?:\s+string\s*=\s*" + _Q + r")?\s*>"
    r"(.*?)</" + _D + r"parameter>",
    re.S,
)
_TAG = re.compile(r"</?" + _D + r"(?:invoke|parameter)\b[^>]*>")


def _first(groups: tuple[str | None, ...]) -> str | None:
    return next((g for g in groups if g is not None), None)


def _value(raw: str, marked: str | None, schema: Any) -> Any:
    """A parameter's value: JSON where it is marked so and parses, else as the schema says."""
    if marked == "false":
        try:
            return json.loads(raw)
        except ValueError:
            pass
    elif marked == "true":
        return raw
    return typed_value(raw, schema)


@dataclass(frozen=True)
class DsmlFormat(DelimitedFormat):
    think_open: str | None = "<think>"
    think_close: str | None = "</think>"
    call_open: str | None = f"<{_D}tool_calls>"

    name: ClassVar[str] = "dsml"
    markers: ClassVar[tuple[str, ...]] = (
        f"<{_D}tool_calls>",
        f"</{_D}tool_calls>",
        "<think>",
        "</think>",
    )
    call_begin: ClassVar[str | None] = f"<{_D}invoke"
    call_end: ClassVar[str] = f"</{_D}invoke>"
    call_close: ClassVar[str] = f"</{_D}tool_calls>"

    def _params(self, body: str) -> tuple[list[tuple[str, str | None, str]], int]:
        """Each complete parameter (name, string mark, raw value), and where they end."""
        pos, found = 0, []
        while p := _PARAM.match(body, pos):
            found.append((_first(p.groups()[:3]) or "", _first(p.groups()[3:6]), p.group(7)))
            pos = p.end()
        return found, pos

    def parse_call(self, text: str, schemas: Mapping[str, Any]) -> dict[str, Any] | None:
        m = _INVOKE.match(text)
        if m is None:
            return None
        name = _first(m.groups()[:3])
        params, pos = self._params(m.group(4))
        if not name or m.group(4)[pos:].strip():
            return None
        args = {k: _value(v, s, parameter_schema(schemas, name, k)) for k, s, v in params}
        return call_event(name, args)

    def partial_call(self, text: str) -> tuple[str, str]:
        m = _INVOKE.match(text)
        if m is None:
            return "", ""
        params, _ = self._params(m.group(4))
        return _first(m.groups()[:3]) or "", open_object({k: v for k, _, v in params})

    def readable(self, text: str) -> str:
        return without(_TAG.sub(" ", text), self.markers)

    def call_rules(
        self, lark: Lark, tools: list[dict[str, Any]], lenient: bool, parallel: bool
    ) -> str:
        def pair(key: str, value: str, text: bool) -> str:
            mark = "true" if text else "false"
            head = f'"<{_D}parameter name=\\"" {key} "\\" string=\\"{mark}\\">"'
            return f'{head} {value} "\\n"?'

        return invoke_section(
            lark,
            tools,
            head=lambda name: f'<{_D}invoke name="{name}">',
            pair=pair,
            close=(f"</{_D}parameter>", self.call_end, self.call_close),
            lenient=lenient,
            parallel=parallel,
        )
