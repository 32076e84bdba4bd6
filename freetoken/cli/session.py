"""State of a `run` (one-shot or interactive) and the streaming of one answer.

`Session` holds what the REPL's `/set` commands change; its `chat_body` and
`generate_body` are the exact requests sent, so tests can check them without a server.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from typing import Any, TextIO

from freetoken.cli.client import Client
from freetoken.cli.display import stats_block
from freetoken.cli.errors import CommandError
from freetoken.cli.render import AnswerPrinter

__all__ = ["Reply", "Session", "parse_think", "stream_reply"]

THINK_LEVELS = ("low", "medium", "high", "max")


def parse_think(value: str | None) -> bool | str | None:
    """`--think` / `/set think` values: true, false or a level."""
    if value is None:
        return None
    v = value.strip().lower()
    if v in ("", "true", "1", "yes", "on"):
        return True
    if v in ("false", "0", "no", "off"):
        return False
    if v in THINK_LEVELS:
        return v
    levels = ", ".join(THINK_LEVELS)
    raise CommandError(f"invalid think value {value!r}: use true, false or one of {levels}")


@dataclass
class Session:
    model: str
    options: dict[str, Any] = field(default_factory=dict)
    system: str | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    format: str | None = None
    think: bool | str | None = None
    hide_thinking: bool = False
    verbose: bool = False
    wordwrap: bool = True
    keep_alive: str | None = None

    def _common(self) -> dict[str, Any]:
        body: dict[str, Any] = {}
        if self.options:
            body["options"] = dict(self.options)
        if self.format:
            body["format"] = self.format
        if self.think is not None:
            body["think"] = self.think
        if self.keep_alive is not None:
            body["keep_alive"] = self.keep_alive
        return body

    def chat_body(self) -> dict[str, Any]:
        messages = list(self.messages)
        if self.system:
            messages.insert(0, {"role": "system", "content": self.system})
        return {"model": self.model, "messages": messages, "stream": True, **self._common()}

    def generate_body(self, prompt: str) -> dict[str, Any]:
        body = {"model": self.model, "prompt": prompt, "stream": True, **self._common()}
        if self.system:
            body["system"] = self.system
        return body


@dataclass
class Reply:
    content: str
    thinking: str
    final: dict[str, Any]


def _wrap_width(session: Session, out: TextIO) -> int | None:
    if not session.wordwrap or not out.isatty():
        return None
    # One column spare: a character in the last column makes some terminals wrap early.
    return shutil.get_terminal_size().columns - 1


def stream_reply(
    client: Client, path: str, body: dict[str, Any], session: Session, out: TextIO, err: TextIO
) -> Reply:
    """Streams one answer from /api/chat or /api/generate to `out`.

    Ctrl-C (KeyboardInterrupt) propagates after the HTTP stream is closed, which cancels
    the request on the server, and after the terminal is left on a fresh line.
    """
    printer = AnswerPrinter(
        out,
        width=_wrap_width(session, out),
        color=out.isatty(),
        hide_thinking=session.hide_thinking,
    )
    content: list[str] = []
    thinking: list[str] = []
    final: dict[str, Any] = {}
    chunks = client.stream(path, body)
    try:
        for chunk in chunks:
            if path == "/api/chat":
                part = chunk.get("message") or {}
                text_delta = part.get("content") or ""
            else:
                part = chunk
                text_delta = part.get("response") or ""
            think_delta = part.get("thinking") or ""
            thinking.append(think_delta)
            content.append(text_delta)
            printer.thinking(think_delta)
            printer.content(text_delta)
            if chunk.get("done"):
                final = chunk
    finally:
        chunks.close()
        printer.finish()
    if session.verbose:
        err.write(stats_block(final))
        err.flush()
    return Reply("".join(content), "".join(thinking), final)
