"""Splitting generated text into content, thinking and tool calls, while it streams, for
every format whose output is text with markers in it (markup.py): the generic parser.

The format says what the markers are and how a tool-call section reads; this parser does
the rest the same way for all of them: text that might be the start of a marker is held
back until it is decided, so markup never leaks into content (the most reported Ollama
tool bug), and content before a tool call still streams.

- thinking lies between the format's think markers (the output may start inside it when
  the prompt opened it); only the first thing the model writes may open it;
- a tool-call section starts at the format's call marker; the section (formats/base.py,
  CallSection) says where it ends and which calls it held;
- a format that takes bare calls (Qwen's) makes an answer that is one JSON call a call,
  when tools were offered.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from freetoken.chat.formats.base import CallSection, Event, ParseOptions
from freetoken.chat.formats.scan import partial_suffix, truncated_call

if TYPE_CHECKING:
    from freetoken.chat.formats.markup import MarkupFormat

__all__ = ["OutputParser"]


@dataclass
class OutputParser:
    fmt: MarkupFormat
    tools: bool = False  # tools were offered: calls are parsed (else markup is plain content)
    thinking: bool = False  # the output starts inside a thinking section
    show_thinking: bool = True  # think:false: thinking the model does anyway is dropped
    stream_calls: bool = False  # also emit tool_call_start / tool_call_delta while a call grows
    schemas: Mapping[str, Any] = field(default_factory=dict)  # offered tools' parameters
    _section: CallSection | None = None
    _buf: str = ""
    _mode: str = field(default="")  # "", "think", "call"
    _content_seen: bool = False
    _calls: int = 0
    _lead: str = ""  # whitespace before anything else: dropped if thinking follows
    _held: str = ""  # content that may be a bare JSON tool call
    _thought: bool = False

    def __post_init__(self) -> None:
        self._mode = "think" if self.thinking and self.fmt.think_close else ""

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        while self._step(out):
            pass
        return out

    def finish(self, cut: bool = False) -> list[Event]:
        out: list[Event] = []
        rest, self._buf = self._buf, ""
        if self._mode == "call":
            events, end = self._section.finish(rest, cut)
            self._take(out, events)
            self._mode, self._section = "", None
            if end < len(rest):
                # the section ended earlier than it seemed: what follows is read again
                self._buf = rest[end:]
                while self._step(out):
                    pass
                return out + self.finish(cut)
        elif self._mode == "think":
            self._emit(out, "thinking", rest)
        else:
            tail = self._call_open_tail(rest) if cut and self.tools else ""
            self._emit(out, "content", rest[: len(rest) - len(tail)])
            if tail:  # the limit cut a call's opening marker: a cut call, never content
                out.append(truncated_call(self._calls, "", ""))
        if self._lead:
            out.append({"content": self._lead})  # an answer of whitespace only
            self._lead = ""
        if self._held:
            call = self.fmt.bare_call(self._held)
            # an answer that is one bare JSON call is a call; anything else was content after
            # all, unless the limit cut the call short
            if call:
                out.append({"tool_calls": [call]})
            elif cut:
                out.append(truncated_call(self._calls, *self.fmt.partial_call(self._held)))
            else:
                out.append({"content": self._held})
            self._held = ""
        return out

    def _call_open_tail(self, text: str) -> str:
        """The end of `text` that begins the call marker, two characters at least (a lone
        "<" or "[" is as likely the end of the content)."""
        marker = self.fmt.call_open or ""
        for n in range(min(len(marker) - 1, len(text)), 1, -1):
            if text.endswith(marker[:n]):
                return text[-n:]
        return ""

    def _markers(self) -> list[tuple[str, str]]:
        f = self.fmt
        if self._mode == "think":
            return [("end_think", f.think_close)] if f.think_close else []
        found = []
        if f.think_open and not self._content_seen:
            found.append(("think", f.think_open))
        if f.call_open and self.tools:
            found.append(("call", f.call_open))
        return found

    def _step(self, out: list[Event]) -> bool:
        """Consumes what can be decided; True if it should be called again."""
        if self._mode == "call":
            return self._read_call(out)
        markers = self._markers()
        hits = [(at, kind, m) for kind, m in markers if (at := self._buf.find(m)) >= 0]
        if hits:
            at, kind, marker = min(hits)
            before, self._buf = self._buf[:at], self._buf[at + len(marker) :]
            self._flush(out, before)
            if kind in ("think", "call"):
                self._lead = ""  # whitespace before thinking or a call is no answer
            self._mode = {"think": "think", "call": "call"}.get(kind, "")
            self._thought = self._thought or kind in ("think", "end_think")
            if kind == "call":
                opts = ParseOptions(self.tools, self.schemas, stream_calls=self.stream_calls)
                self._section = self.fmt.section(self._calls, opts)
            return True
        hold = max((partial_suffix(self._buf, m) for _, m in markers), default=0)
        text = self._buf[: len(self._buf) - hold]
        self._buf = self._buf[len(self._buf) - hold :]
        self._flush(out, text)
        return False

    def _read_call(self, out: list[Event]) -> bool:
        events, end = self._section.feed(self._buf)
        self._take(out, events)
        if end < 0:
            return False  # each call is emitted once it is complete
        self._buf, self._mode, self._section = self._buf[end:], "", None
        return True

    def _take(self, out: list[Event], events: list[Event]) -> None:
        self._calls += sum(1 for e in events if "tool_calls" in e)
        out += events

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
        if not self._content_seen and not self._thought and not (self._lead + text).strip():
            self._lead += text  # maybe the whitespace before thinking
            return
        text, self._lead = self._lead + text, ""
        if (
            self.fmt.bare_calls
            and self.tools
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
