"""gpt-oss's Harmony format: the output is a series of messages, each a header and a body,

    <|channel|>analysis<|message|>…<|end|><|start|>assistant<|channel|>final<|message|>…<|return|>

The `analysis` channel is thinking; a message with a recipient (`commentary
to=functions.NAME <|constrain|>json<|message|>{args}<|call|>`, or the recipient before the
channel) is a tool call; `final`, a commentary without recipient (a preamble) and any other
channel are content. The prompt usually ends with `<|start|>assistant`, so the output
begins with `<|channel|>`. `<|return|>` and `<|call|>` end the output (they are the model's
stop tokens), `<|end|>` ends a message. Text that is no header at all is content.

Harmony templates read the think level as `reasoning_effort`. Thinking is part of the
message structure, so grammars write it: a forced answer is analysis messages, then calls;
under `auto`, analysis and preamble messages, then a final answer or calls. A message body
holds no `<|`, so no header can hide in one; a thinking budget ends the analysis message.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, ClassVar

from freetoken.chat.formats.base import ChatFormat, Event, ParseOptions
from freetoken.chat.formats.scan import (
    ArgumentStream,
    call_event,
    partial_suffix,
    truncated_call,
    without,
)
from freetoken.chat.grammar import Grammar, Lark, lit
from freetoken.chat.structured import named_calls

__all__ = ["HarmonyFormat", "HarmonyParser"]

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, CALL, RETURN = "<|constrain|>", "<|call|>", "<|return|>"
_ENDS = (END, CALL, RETURN)  # end a message
_OPENS = (START, CHANNEL)  # begin a header (also where the model left a message open)
_MARKERS = (*_ENDS, *_OPENS, MESSAGE, CONSTRAIN)
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_BODY = r"([^<]|<[^|])*"  # message text: no marker starts in it
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")


@dataclass(frozen=True)
class HarmonyFormat(ChatFormat):
    name: ClassVar[str] = "harmony"
    markers: ClassVar[tuple[str, ...]] = _MARKERS

    grammar_thinks: ClassVar[bool] = True

    def parser(self, opts: ParseOptions) -> HarmonyParser:
        return HarmonyParser(opts, *_opening(opts.prompt))

    def thinking_bounds(self) -> tuple[str, str]:
        return f"{CHANNEL}analysis{MESSAGE}", END

    def call_grammar(
        self,
        tools: list[dict[str, Any]],
        *,
        parallel: bool = True,
        lenient: bool = False,
        think: bool = True,
    ) -> Grammar:
        # one call a message, and `<|call|>` ends the output: never parallel
        lark = Lark()
        call = self._call(lark, tools, lenient)
        return lark.grammar(f"{_message(lark, 'analysis')}* {call}" if think else call)

    def auto_grammar(
        self, tools: list[dict[str, Any]], *, parallel: bool = True, think: bool = True
    ) -> Grammar:
        lark = Lark()
        call = self._call(lark, tools, True)
        kinds = ("analysis", "commentary") if think else ("commentary",)
        notes = f"({' | '.join(_message(lark, k) for k in kinds)})*"
        final = f"{lit(CHANNEL + 'final' + MESSAGE)} /{_BODY}<?/"
        return lark.grammar(f"{notes} ({final} | {call})?")

    @staticmethod
    def _call(lark: Lark, tools: list[dict[str, Any]], lenient: bool) -> str:
        """A call message's header and JSON arguments (`<|call|>`, a stop token, ends it)."""

        def around(fn: str) -> tuple[str, str]:
            return lit(f"{CHANNEL}commentary to=functions.{fn} {CONSTRAIN}json{MESSAGE}"), '""'

        return named_calls(lark, tools, lenient, around)


def _message(lark: Lark, channel: str) -> str:
    """A whole message on `channel` and the next message's start."""
    body = lark.rule(f"/{_BODY}<\\|end\\|>/", "[lazy]")
    return lark.rule(f"{lit(CHANNEL + channel + MESSAGE)} {body} {lit(START + 'assistant')}")


def _opening(prompt: str) -> tuple[str, str]:
    """Where the output starts: ("head", the header the prompt began) or ("body", the
    header of the message whose body the prompt opened)."""
    at = prompt.rfind(START)
    tail = prompt[at + len(START) :] if at >= 0 else ""
    if at < 0 or any(m in tail for m in _ENDS):
        return "head", ""
    if MESSAGE in tail:
        return "body", tail[: tail.index(MESSAGE)]
    return "head", tail


class HarmonyParser:
    def __init__(self, opts: ParseOptions, mode: str, head: str):
        self.opts = opts
        self.buf = ""
        self.mode, self.head = mode, head  # "head": reading a header; "body": a message
        self.kind, self.name = "content", ""  # the message's: content, thinking or call
        self.body = ""  # a call's arguments so far
        self.calls = 0
        self.args: ArgumentStream | None = None
        if mode == "body":
            self._open(head)

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        out: list[Event] = []
        while self._head(out) if self.mode == "head" else self._body(out):
            pass
        return out

    def finish(self, cut: bool = False) -> list[Event]:
        out: list[Event] = []
        rest, self.buf = self.buf, ""
        if self.mode == "body":
            self._text(out, rest)
            self._close(out, cut)
        elif not any(m in self.head + rest for m in _MARKERS):
            self._text(out, rest.strip())  # an answer with no header at all
        elif cut and self.opts.tools and (to := _RECIPIENT.search(self.head + rest)):
            name = to.group(1).removeprefix("functions.")  # a call's header the limit cut
            out.append(truncated_call(self.calls, name, ""))
        return out

    def _head(self, out: list[Event]) -> bool:
        at = self.buf.find(MESSAGE)
        if at >= 0:
            header, self.buf = self.head + self.buf[:at], self.buf[at + len(MESSAGE) :]
            self.mode, self.head = "body", ""
            self._open(header)
            return True
        if not any(m in self.head for m in _MARKERS) and not _header_like(self.buf):
            self.mode, self.kind = "body", "content"  # plain text: the model wrote no header
            return True
        return False  # a header is short: it waits whole for its <|message|>

    def _body(self, out: list[Event]) -> bool:
        hits = [(at, m) for m in _MARKERS if (at := self.buf.find(m)) >= 0]
        if not hits:
            hold = max(partial_suffix(self.buf, m) for m in _MARKERS)
            self._text(out, self.buf[: len(self.buf) - hold])
            self.buf = self.buf[len(self.buf) - hold :]
            return False
        at, marker = min(hits)
        self._text(out, self.buf[:at])
        self.buf = self.buf[at + len(marker) :]
        if marker in (MESSAGE, CONSTRAIN):
            return True  # stray header markup inside a body: dropped
        self._close(out)
        self.mode, self.head = "head", marker if marker == CHANNEL else ""
        return True

    def _open(self, header: str) -> None:
        recipient, channel = _RECIPIENT.search(header), _CHANNEL.search(header)
        self.body, self.args = "", None
        if recipient and self.opts.tools:
            self.kind, self.name = "call", recipient.group(1).removeprefix("functions.")
            if self.opts.stream_calls:
                self.args = ArgumentStream(self.calls, self._arguments_start)
        elif channel and channel.group(1) == "analysis":
            self.kind = "thinking"
        else:
            self.kind = "content"

    def _arguments_start(self, body: str) -> tuple[int, str] | None:
        rest = body.lstrip()
        return (len(body) - len(rest), self.name) if rest else None

    def _text(self, out: list[Event], text: str) -> None:
        if not text:
            return
        if self.kind == "call":
            self.body += text
            if self.args is not None:
                out += self.args.feed(self.body)
        elif self.kind == "thinking":
            if self.opts.show_thinking:
                out.append({"thinking": text})
        else:
            out.append({"content": text})

    def _close(self, out: list[Event], cut: bool = False) -> None:
        """The message ended: a call's arguments are complete (unless the limit `cut` it)."""
        if self.kind != "call":
            return
        streamed = self.args is not None and self.args.started
        self.kind, self.args = "content", None
        try:
            args = json.loads(self.body)
        except ValueError:
            args = None
        if not isinstance(args, dict) and cut:
            out.append(truncated_call(self.calls, self.name, self.body.lstrip()))
            return
        if not isinstance(args, dict):
            shown = without(self.body, _MARKERS)  # shown, not lost
            out += [{"content": shown}] if shown else []
            return
        self.calls += 1
        call = call_event(self.name, args)
        out.append({"tool_calls": [call], **({"streamed": True} if streamed else {})})


def _header_like(text: str) -> bool:
    """Whether text may still be (the start of) a message header."""
    t = text.lstrip()
    return not t or t[0] == "<" or t.startswith("to=") or "to=".startswith(t)
