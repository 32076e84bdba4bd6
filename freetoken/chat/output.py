"""Splitting generated text into content, thinking and tool calls, while it streams.

The family's conventions are chosen from the model (its template), never guessed per
request. Text that might be the start of a marker is held back until it is decided, so
markup never leaks into content (the most reported Ollama tool bug) and content before a
tool call still streams.

Conventions understood:
- thinking between `<think>` and `</think>` (the output may start inside it when the prompt
  opened it);
- tool calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen, Hermes),
  with the XML form `<function=name><parameter=p>v</parameter></function>` inside it
  (Qwen3-Coder), and, when tools were offered, a whole answer that is one bare JSON call.

A JSON call ends at the first close marker outside its JSON strings: a string argument may
hold the marker's text (a forced call's free string can, and so can code about tool calls).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

__all__ = ["OutputParser", "Style", "style_for"]

Event = dict[str, Any]


@dataclass(frozen=True)
class Style:
    think_open: str | None = "<think>"
    think_close: str | None = "</think>"
    call_open: str | None = "<tool_call>"
    call_close: str | None = "</tool_call>"


def style_for(template: str | None) -> Style:
    """The conventions a model's template shows (markers it never mentions are not parsed)."""
    t = template or ""
    thinks = "<think>" in t or "enable_thinking" in t or ".Think" in t
    calls = "<tool_call>" in t
    return Style(
        think_open="<think>" if thinks else None,
        think_close="</think>" if thinks else None,
        call_open="<tool_call>" if calls else None,
        call_close="</tool_call>" if calls else None,
    )


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


_XML_FUNC = re.compile(r"<function=([^>\s]+)>(.*?)</function>", re.S)
_XML_PARAM = re.compile(r"<parameter=([^>\s]+)>(.*?)</parameter>", re.S)


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
        return {"function": {"name": m.group(1), "arguments": args}}
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"function": {"name": obj["name"], "arguments": args}}


class _CallEnd:
    """Finds where a call's body ends, scanning only the text not scanned before.

    A body that starts as JSON ends at the first close marker outside a JSON string; any
    other body (the XML function form, where a quote is plain text) at the first marker.
    """

    def __init__(self, close: str):
        self.close = close
        self.pos = self.depth = 0
        self.json: bool | None = None  # undecided until the body's first visible character
        self.in_str = self.esc = False

    def find(self, body: str) -> int:
        """The index of the close marker in the body written so far, or -1."""
        if self.json is None:
            head = body.lstrip()
            if not head:
                return -1
            self.json = head[0] == "{"
        if not self.json:
            return body.find(self.close)
        i, n = self.pos, len(self.close)
        while i < len(body):
            ch = body[i]
            if self.in_str:
                self.esc, self.in_str = (False, True) if self.esc else (ch == "\\", ch != '"')
            elif ch == self.close[0] and self.close.startswith(body[i : i + n]):
                if len(body) - i >= n:
                    return i
                break  # maybe the marker's start: decided by the next text
            elif ch == '"':
                self.in_str = self.depth > 0  # after the object, quotes are not JSON
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth = max(self.depth - 1, 0)
            i += 1
        self.pos = i
        return -1


_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')


class _ArgumentStream:
    """The raw JSON text of a call's arguments, streamed as it is generated.

    Once `{"name": "...", "arguments": ` has been written, every further character up to the
    end of the arguments object goes out as a delta, so /v1 clients see arguments grow token
    by token; the whole call still follows, for APIs that send calls whole.
    """

    def __init__(self, index: int):
        self.index, self.pos, self.depth = index, 0, 0
        self.started = self.done = self.off = False
        self.in_str = self.esc = False

    def feed(self, body: str) -> list[Event]:
        out: list[Event] = []
        if self.off or self.done:
            return out
        if not self.started:
            m = _CALL_HEAD.match(body)
            if not m or m.end() >= len(body):
                return out  # not decided yet
            if body[m.end()] != "{":
                self.off = True  # arguments that are not an object are only sent whole
                return out
            self.started, self.pos = True, m.end()
            out.append({"tool_call_start": {"index": self.index, "name": json.loads(m.group(1))}})
        i = start = self.pos
        while i < len(body) and not self.done:
            ch = body[i]
            i += 1
            if self.in_str:
                self.esc, self.in_str = (False, True) if self.esc else (ch == "\\", ch != '"')
            elif ch == '"':
                self.in_str = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                self.done = self.depth == 0
        if i > start:
            out.append({"tool_call_delta": {"index": self.index, "arguments": body[start:i]}})
            self.pos = i
        return out


@dataclass
class OutputParser:
    style: Style
    tools: bool = False  # tools were offered: calls are parsed (else markup is plain content)
    thinking: bool = False  # the output starts inside a thinking section
    show_thinking: bool = True  # think:false: thinking the model does anyway is dropped
    stream_calls: bool = False  # also emit tool_call_start / tool_call_delta while a call grows
    _args: _ArgumentStream | None = None
    _end: _CallEnd | None = None
    _buf: str = ""
    _mode: str = field(default="")  # "", "think", "call"
    _content_seen: bool = False
    _calls: int = 0
    _held: str = ""  # content that may be a bare JSON tool call
    _thought: bool = False

    def __post_init__(self) -> None:
        self._mode = "think" if self.thinking and self.style.think_close else ""

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[Event]:
        out: list[Event] = []
        rest, self._buf = self._buf, ""
        close = self.style.call_close
        if self._mode == "call" and close and close in rest and parse_call(rest) is None:
            # a string that never closed hid the marker: the call ended there after all
            at = rest.index(close)
            out += self._end_call(rest[:at], close)
            self._mode, self._buf = "", rest[at + len(close) :]
            while self._step(out):
                pass
            return out + self.finish()
        if self._mode == "call":
            out += self._end_call(rest, "")
        elif self._mode == "think":
            self._emit(out, "thinking", rest)
        else:
            self._emit(out, "content", rest)
        if self._held:
            call = parse_call(self._held)
            # an answer that is one bare JSON call is a call; anything else was content after all
            out.append({"tool_calls": [call]} if call else {"content": self._held})
            self._held = ""
        return out

    def _open(self) -> str:
        return self.style.call_open or ""

    def _markers(self) -> list[tuple[str, str]]:
        s = self.style
        if self._mode == "think":
            return [("end_think", s.think_close)] if s.think_close else []
        if self._mode == "call":
            return [("end_call", s.call_close)] if s.call_close else []
        found = []
        if s.think_open and not self._content_seen:
            found.append(("think", s.think_open))
        if s.call_open and self.tools:
            found.append(("call", s.call_open))
        return found

    def _step(self, out: list[Event]) -> bool:
        """Consumes what can be decided; True if it should be called again."""
        markers = self._markers()
        hits = [(at, kind, m) for kind, m in markers if (at := self._find(kind, m)) >= 0]
        if hits:
            at, kind, marker = min(hits)
            before, self._buf = self._buf[:at], self._buf[at + len(marker) :]
            self._flush(out, before)
            self._mode = {"think": "think", "call": "call"}.get(kind, "")
            self._thought = self._thought or kind in ("think", "end_think")
            if kind == "call":
                self._end = _CallEnd(self.style.call_close) if self.style.call_close else None
                self._args = _ArgumentStream(self._calls) if self.stream_calls else None
            if kind == "end_call":
                out += self._end_call(before, marker)
            return True
        if self._mode == "call":
            if self._args is not None:
                out += self._args.feed(self._buf)
            return False  # the whole call is emitted once it is complete
        hold = max((_partial_suffix(self._buf, m) for _, m in markers), default=0)
        text = self._buf[: len(self._buf) - hold]
        self._buf = self._buf[len(self._buf) - hold :]
        self._flush(out, text)
        return False

    def _find(self, kind: str, marker: str) -> int:
        if kind == "end_call" and self._end is not None:
            return self._end.find(self._buf)
        return self._buf.find(marker)

    def _end_call(self, body: str, marker: str) -> list[Event]:
        out = self._args.feed(body) if self._args is not None else []
        streamed = self._args is not None and self._args.started
        self._args = None
        call = parse_call(body)
        if call is None:  # an unparseable call is shown as text rather than silently lost
            return out + [{"content": self._open() + body + marker}]
        self._calls += 1
        return out + [{"tool_calls": [call], **({"streamed": True} if streamed else {})}]

    def _flush(self, out: list[Event], text: str) -> None:
        if self._mode == "think":
            self._emit(out, "thinking", text)
        elif self._mode == "":
            self._emit(out, "content", text)

    def _emit(self, out: list[Event], kind: str, text: str) -> None:
        if not text:
            return
        if kind == "thinking":
            self._thought = True
            if self.show_thinking:
                out.append({"thinking": text})
            return
        if not self._content_seen and self._thought:
            text = text.lstrip()  # the whitespace between </think> and the answer
            if not text:
                return
        if (
            self.tools
            and not self._calls
            and (self._held or not self._content_seen)
            and (self._held + text).lstrip().startswith("{")
        ):
            self._held += text  # maybe a bare JSON call: decided at the end, never leaked
            self._content_seen = True
            return
        if self._held:
            text, self._held = self._held + text, ""
        self._content_seen = True
        out.append({"content": text})
