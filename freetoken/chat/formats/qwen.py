"""Qwen's conventions (also Hermes-style and most templates that show `<tool_call>`), the
format of models no architecture claims another for.

- thinking between `<think>` and `</think>`;
- a call as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, or in the XML form
  `<function=name><parameter=p>v</parameter></function>` inside it (Qwen3-Coder);
- when tools were offered, a whole answer that is one bare JSON call.

Which of these a model uses is read from its template: a marker it never mentions is not
parsed. A JSON call ends at the first close marker outside its JSON strings. A call that
does not parse is shown with its markers, as it always was for these models.
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
    MarkerScan,
    call_event,
    json_call,
    regex_head,
    truncated_call,
)
from freetoken.chat.grammar import Grammar, Lark, lit, tagged_arguments
from freetoken.chat.structured import json_calls

__all__ = ["QwenFormat", "parse_call"]

_XML_NAME = re.compile(r"<function=([^>\s]+)>")
_XML_FUNC = re.compile(r"<function=([^>\s]+)>(.*?)</function>", re.S)
_XML_PARAM = re.compile(r"<parameter=([^>\s]+)>(.*?)</parameter>", re.S)
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')


def _json_name(m: re.Match[str]) -> str:
    return json.loads(m.group(1))


def parse_call(body: str) -> dict[str, Any] | None:
    """A tool call from the text between the call markers (JSON, or the XML function form)."""
    body = body.strip()
    m = _XML_FUNC.search(body)
    if m:
        args = {}
        for name, raw in _XML_PARAM.findall(m.group(2)):
            raw = raw.strip()
            try:
                args[name] = json.loads(raw)
            except ValueError:
                args[name] = raw
        return call_event(m.group(1), args)
    try:
        return json_call(json.loads(body))
    except ValueError:
        return None


@dataclass(frozen=True)
class QwenFormat(MarkupFormat):
    think_open: str | None = "<think>"
    think_close: str | None = "</think>"
    call_open: str | None = "<tool_call>"
    call_close: str | None = "</tool_call>"
    xml: bool = False  # forced calls in the XML function form (the template shows it)

    name: ClassVar[str] = "qwen"
    markers: ClassVar[tuple[str, ...]] = ("<think>", "</think>", "<tool_call>", "</tool_call>")
    bare_calls: ClassVar[bool] = True

    @classmethod
    def from_template(cls, template: str | None) -> QwenFormat:
        """The markers the template shows (markers it never mentions are not parsed)."""
        t = template or ""
        thinks = "<think>" in t or "enable_thinking" in t or ".Think" in t
        calls = "<tool_call>" in t
        return cls(
            think_open="<think>" if thinks else None,
            think_close="</think>" if thinks else None,
            call_open="<tool_call>" if calls else None,
            call_close="</tool_call>" if calls else None,
            xml="<function=" in t,
        )

    def section(self, index: int, opts: ParseOptions) -> CallSection:
        return _QwenCall(self, index, opts.stream_calls)

    def bare_call(self, text: str) -> dict[str, Any] | None:
        return parse_call(text)

    def partial_call(self, text: str) -> tuple[str, str]:
        head = _HEAD(text)
        if head is not None:
            return head[1], text[head[0] :]
        m = _XML_NAME.search(text)
        return (m.group(1), "") if m else ("", "")

    def call_grammar(
        self,
        tools: list[dict[str, Any]],
        *,
        parallel: bool = True,
        lenient: bool = False,
        think: bool = True,
    ) -> Grammar | None:
        if self.call_open:
            return super().call_grammar(tools, parallel=parallel, lenient=lenient, think=think)
        lark = Lark()  # without call markers, the call is the bare JSON object
        return lark.grammar(json_calls(lark, tools, lenient))

    def call_rules(
        self, lark: Lark, tools: list[dict[str, Any]], lenient: bool, parallel: bool
    ) -> str:
        if self.xml:
            calls = lark.rule(" | ".join(f"({_xml_call(lark, fn, lenient)})" for fn in tools))
        else:
            calls = json_calls(lark, tools, lenient)
        return lark.rule(f'"\\n"? {calls} "\\n"? {lit(self.call_close or "")}')


def _xml_call(lark: Lark, fn: dict[str, Any], lenient: bool) -> str:
    """`<function=NAME>` and one `<parameter=KEY>` pair per argument (Qwen3-Coder's form)."""

    def pair(key: str, value: str, text: bool) -> str:
        return f'"<parameter=" {key} ">" "\\n"? {value} "\\n"?'

    args = tagged_arguments(lark, fn, pair, "</parameter>", lenient)
    return f'{lit("<function=" + fn["name"] + ">")} "\\n"? {args} "</function>"'


_HEAD = regex_head(_CALL_HEAD, _json_name)


class _QwenCall(CallSection):
    """One call, up to the close marker."""

    def __init__(self, fmt: QwenFormat, index: int, stream: bool):
        self.fmt, self.index = fmt, index
        self.close = fmt.call_close or ""
        self.scan = MarkerScan(self.close, json=None)
        self.args = ArgumentStream(index, _HEAD) if stream else None

    def feed(self, body: str) -> tuple[list[Event], int]:
        at = self.scan.find(body) if self.close else -1
        if at >= 0:
            return self._end(body[:at], self.close), at + len(self.close)
        return (self.args.feed(body) if self.args is not None else []), -1

    def finish(self, body: str, cut: bool = False) -> tuple[list[Event], int]:
        close = self.close
        if cut and not (close and close in body) and parse_call(body) is None:
            out = self.args.feed(body) if self.args is not None else []
            return out + [truncated_call(self.index, *self.fmt.partial_call(body))], len(body)
        if close and close in body and parse_call(body) is None:
            # a string that never closed hid the marker: the call ended there after all
            at = body.index(close)
            return self._end(body[:at], close), at + len(close)
        return self._end(body, ""), len(body)

    def _end(self, body: str, marker: str) -> list[Event]:
        out = self.args.feed(body) if self.args is not None else []
        streamed = self.args is not None and self.args.started
        self.args = None
        call = parse_call(body)
        if call is None:  # an unparseable call is shown as text rather than silently lost
            return out + [{"content": (self.fmt.call_open or "") + body + marker}]
        return out + [{"tool_calls": [call], **({"streamed": True} if streamed else {})}]
