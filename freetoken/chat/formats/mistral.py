"""Mixtral and Mistral: no thinking; tool calls after the `[TOOL_CALLS]` control token,
in either of two forms:

- a JSON list, `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (the tokenizers
  Mixtral shipped with);
- `[TOOL_CALLS]NAME[ARGS]{...}`, one call per `[TOOL_CALLS]`, optionally with
  `[CALL_ID]ID` before `[ARGS]` (newer tokenizers).

The section has no close marker: it ends with the JSON value. Both forms are read; a forced
call is written in the form the model's template shows.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, ClassVar

from freetoken.chat.formats.base import CallSection, Event, ParseOptions
from freetoken.chat.formats.markup import MarkupFormat
from freetoken.chat.formats.scan import (
    ArgumentStream,
    JsonEnd,
    call_event,
    json_call,
    regex_head,
    truncated_call,
)
from freetoken.chat.grammar import Lark, lit
from freetoken.chat.structured import json_calls, named_calls

__all__ = ["MistralFormat"]

CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_LIST = re.compile(r"\s*\[\s*[{\]]")
_UNDECIDED = re.compile(r"\s*\[?\s*")
_NAMED = re.compile(r"\s*([^\[\]\s{}]+)\s*(?:\[CALL_ID\][^\[]*)?\[ARGS\]\s*")
_HEAD = regex_head(_NAMED)
_ITEM_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')


def _whole_items(body: str) -> tuple[list[dict[str, Any]], str]:
    """The calls of a JSON list whose end was cut, as far as they are whole, and the text
    of the one after them."""
    pos, calls, decoder = body.find("[") + 1, [], json.JSONDecoder()
    while True:
        while pos < len(body) and body[pos] in " \n\t,":
            pos += 1
        try:
            item, end = decoder.raw_decode(body, pos)
        except ValueError:
            return calls, body[pos:]
        call = json_call(item)
        if call is None:
            return calls, body[pos:]
        calls.append(call)
        pos = end


@dataclass(frozen=True)
class MistralFormat(MarkupFormat):
    call_open: str | None = CALLS
    listed: bool = True  # forced calls as a JSON list (else NAME[ARGS]{...})

    name: ClassVar[str] = "mistral"
    markers: ClassVar[tuple[str, ...]] = (CALLS, ARGS, CALL_ID)
    calls_between: ClassVar[str] = '""'

    @classmethod
    def from_template(cls, template: str | None) -> MistralFormat:
        return cls(listed=ARGS not in (template or ""))

    def section(self, index: int, opts: ParseOptions) -> CallSection:
        return _Calls(self, index, opts.stream_calls)

    def call_rules(
        self, lark: Lark, tools: list[dict[str, Any]], lenient: bool, parallel: bool
    ) -> str:
        if self.listed:
            call = json_calls(lark, tools, lenient)
            more = f'(", " {call})*' if parallel else ""
            return lark.rule(f'"[" {call} {more} "]"')
        return named_calls(lark, tools, lenient, lambda fn: (lit(fn + ARGS), '""'))


class _Calls(CallSection):
    """The calls after one `[TOOL_CALLS]`, up to the end of their JSON."""

    def __init__(self, fmt: MistralFormat, index: int, stream: bool):
        self.fmt, self.index = fmt, index
        self.end = JsonEnd()
        self.args = ArgumentStream(index, _HEAD) if stream else None

    def feed(self, body: str) -> tuple[list[Event], int]:
        if _LIST.match(body):
            end = self.end.feed(body)
            return ([], -1) if end < 0 else (self._listed(body[:end]), end)
        if _UNDECIDED.fullmatch(body):
            return [], -1
        head = _HEAD(body)
        if head is None:
            return [], -1
        out = self.args.feed(body) if self.args is not None else []
        self.end.pos = max(self.end.pos, head[0])  # "[ARGS]" is no JSON
        end = self.end.feed(body)
        if end < 0:
            return out, -1
        return out + self._named(head[1], body[head[0] : end]), end

    def finish(self, body: str, cut: bool = False) -> tuple[list[Event], int]:
        out, end = self.feed(body)
        if end >= 0:
            return out, end
        if cut:
            return out + self._cut(body), len(body)
        shown = self.fmt.readable(body)  # cut short: shown, not lost
        return out + ([{"content": shown}] if shown else []), len(body)

    def _cut(self, body: str) -> list[Event]:
        """The limit cut the section: the whole calls of a list, then the one it cut."""
        if _LIST.match(body) or _UNDECIDED.fullmatch(body):
            calls, rest = _whole_items(body)
            m = _ITEM_HEAD.match(rest)
            name, args = (json.loads(m.group(1)), rest[m.end() :]) if m else ("", "")
            cut = truncated_call(self.index + len(calls), name, args)
            return [{"tool_calls": [c]} for c in calls] + [cut]
        head = _HEAD(body)
        return [truncated_call(self.index, *((head[1], body[head[0] :]) if head else ("", "")))]

    def _named(self, name: str, args: str) -> list[Event]:
        streamed = self.args is not None and self.args.started
        try:
            value = json.loads(args)
        except ValueError:
            value = None
        if not isinstance(value, dict):
            return [{"content": self.fmt.readable(name + args)}]
        return [
            {"tool_calls": [call_event(name, value)], **({"streamed": True} if streamed else {})}
        ]

    def _listed(self, text: str) -> list[Event]:
        try:
            items = json.loads(text)
        except ValueError:
            items = None
        calls = [json_call(x) for x in items] if isinstance(items, list) else [None]
        if None in calls:
            return [{"content": self.fmt.readable(text)}]
        return [{"tool_calls": [c]} for c in calls]
