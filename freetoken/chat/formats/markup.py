"""Formats whose output is text with markers in it, read by the generic OutputParser
(parser.py): think markers, a marker that opens a tool-call section, and a section
reader. `DelimitedFormat` is the common shape of a section: calls between begin and end
markers up to the section's close (DeepSeek, MiniMax-M2), or one call up to the close
(GLM-4.5)."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from freetoken.chat.formats.base import CallSection, ChatFormat, Event, ParseOptions
from freetoken.chat.formats.parser import OutputParser
from freetoken.chat.formats.scan import (
    ArgumentStream,
    MarkerScan,
    partial_suffix,
    truncated_call,
    without,
)
from freetoken.chat.grammar import FREE_TEXT, Grammar, Lark, lit, until

__all__ = ["DelimitedFormat", "DelimitedSection", "MarkupFormat"]


@dataclass(frozen=True)
class MarkupFormat(ChatFormat):
    think_open: str | None = None
    think_close: str | None = None
    call_open: str | None = None  # opens a tool-call section (None: calls are not parsed)
    bare_calls: ClassVar[bool] = False  # an answer that is one bare JSON object is a call
    calls_between: ClassVar[str] = '"\\n"?'  # Lark: between two sections of parallel calls

    @abstractmethod
    def section(self, index: int, opts: ParseOptions) -> CallSection:
        """A reader of one tool-call section, whose first call is the request's `index`th."""

    def bare_call(self, text: str) -> dict[str, Any] | None:
        """The call a whole answer is, for formats with `bare_calls`."""
        return None

    def partial_call(self, text: str) -> tuple[str, str]:
        """A call's name and its arguments' JSON text so far, from a call's text the token
        limit cut ("" where not yet written)."""
        return "", ""

    def readable(self, text: str) -> str:
        """A call that does not parse, as content: its text without the markup."""
        return without(text, self.markers)

    def parser(self, opts: ParseOptions) -> OutputParser:
        # a prompt that ends inside an opened thinking section means the answer starts there
        opened = bool(self.think_open) and opts.prompt.rstrip().endswith(self.think_open)
        return OutputParser(
            self,
            tools=opts.tools,
            thinking=opened,
            show_thinking=opts.show_thinking,
            stream_calls=opts.stream_calls,
            schemas=opts.schemas,
        )

    def thinking_bounds(self) -> tuple[str, str] | None:
        if self.think_open and self.think_close:
            return self.think_open, self.think_close
        return None

    def call_rules(
        self, lark: Lark, tools: list[dict[str, Any]], lenient: bool, parallel: bool
    ) -> str | None:
        """The rule of one call section after its open marker, to its end (None: the format
        cannot write one); `parallel`: a section may hold several calls."""
        return None

    def call_grammar(
        self,
        tools: list[dict[str, Any]],
        *,
        parallel: bool = True,
        lenient: bool = False,
        think: bool = True,
    ) -> Grammar | None:
        lark = Lark()
        rest = self.call_rules(lark, tools, lenient, parallel) if self.call_open else None
        if rest is None:
            return None
        one = f"{lit(self.call_open or '')} {rest}"
        return lark.grammar(f"{one} ({self.calls_between} {one})*" if parallel else one)

    def auto_grammar(
        self, tools: list[dict[str, Any]], *, parallel: bool = True, think: bool = True
    ) -> Grammar | None:
        lark = Lark()
        rest = self.call_rules(lark, tools, True, parallel) if self.call_open else None
        if rest is None:
            return None
        # free text up to the first open marker, then the call: a lazy lexeme ends there
        opened = lark.rule(until(self.call_open or ""), "[lazy]")
        if not parallel:
            return lark.grammar(f"{FREE_TEXT} | {opened} {rest}")
        return lark.grammar(f"({opened} {rest})* {FREE_TEXT}")


@dataclass(frozen=True)
class DelimitedFormat(MarkupFormat):
    call_begin: ClassVar[str | None] = None  # None: the section is one call
    call_end: ClassVar[str] = ""
    call_close: ClassVar[str] = ""  # ends the section
    scan_json: ClassVar[bool] = False  # a call's end marker may sit in its JSON strings
    streams_arguments: ClassVar[bool] = False  # arguments are JSON: they may stream

    @abstractmethod
    def parse_call(self, text: str, schemas: Mapping[str, Any]) -> dict[str, Any] | None:
        """A call from its text between the markers; None if it does not parse."""

    def arguments_start(self, text: str) -> tuple[int, str] | None:
        """Where a call's JSON arguments start in its text so far, and the call's name;
        None while that is not yet written (formats that stream arguments)."""
        return None

    def partial_call(self, text: str) -> tuple[str, str]:
        found = self.arguments_start(text)
        return (found[1], text[found[0] :]) if found else ("", "")

    def section(self, index: int, opts: ParseOptions) -> CallSection:
        return DelimitedSection(self, index, opts)


class DelimitedSection(CallSection):
    def __init__(self, fmt: DelimitedFormat, index: int, opts: ParseOptions):
        self.fmt, self.opts, self.index = fmt, opts, index
        self.end = fmt.call_end if fmt.call_begin else fmt.call_close
        self.pos = 0  # where the text between calls resumes
        self.start = -1  # where the current call's text begins (-1: between calls)
        self.scan = MarkerScan(self.end, fmt.scan_json)
        self.args: ArgumentStream | None = None
        if fmt.call_begin is None:
            self._open(0)

    def _open(self, start: int) -> None:
        self.start, self.scan = start, MarkerScan(self.end, self.fmt.scan_json)
        streams = self.opts.stream_calls and self.fmt.streams_arguments
        self.args = ArgumentStream(self.index, self.fmt.arguments_start) if streams else None

    def feed(self, body: str) -> tuple[list[Event], int]:
        out: list[Event] = []
        fmt = self.fmt
        while True:
            if self.start >= 0:
                text = body[self.start :]
                at = self.scan.find(text)
                if self.args is not None:
                    upto = at if at >= 0 else len(text) - partial_suffix(text, self.end)
                    out += self.args.feed(text[:upto])
                if at < 0:
                    return out, -1
                out += self._call(text[:at])
                self.pos, self.start = self.start + at + len(self.end), -1
                if fmt.call_begin is None:
                    return out, self.pos
                continue
            rest = body[self.pos :]
            close, begin = rest.find(fmt.call_close), rest.find(fmt.call_begin or "")
            if close >= 0 and (begin < 0 or close < begin):
                return out, self.pos + close + len(fmt.call_close)
            if begin < 0:
                return out, -1
            self._open(self.pos + begin + len(fmt.call_begin or ""))

    def finish(self, body: str, cut: bool = False) -> tuple[list[Event], int]:
        out, end = self.feed(body)
        if end >= 0 or self.start < 0:
            return out, end if end >= 0 else len(body)
        text = body[self.start :]
        if cut and self.fmt.parse_call(text, self.opts.schemas) is None:
            out += self.args.feed(text) if self.args is not None else []
            return out + [truncated_call(self.index, *self.fmt.partial_call(text))], len(body)
        # the output ended inside a call: a string never closed may have hidden its end
        cuts = [(i, m) for m in {self.end, self.fmt.call_close} if (i := text.find(m)) >= 0]
        if not cuts:
            return out + self._call(text), len(body)
        at, marker = min(cuts)
        out += self._call(text[:at])
        after = self.start + at + len(marker)
        if marker == self.fmt.call_close:
            return out, after
        self.pos, self.start = after, -1
        more, end = self.finish(body, cut)
        return out + more, end

    def _call(self, text: str) -> list[Event]:
        streamed = self.args is not None and self.args.started
        self.args = None
        call = self.fmt.parse_call(text, self.opts.schemas)
        if call is None:
            shown = self.fmt.readable((self.fmt.call_begin or "") + text)
            return [{"content": shown}] if shown else []
        self.index += 1
        return [{"tool_calls": [call], **({"streamed": True} if streamed else {})}]
