"""Printing a streamed answer: word wrap, and thinking shown dimmed above the answer.

The wrapper only ever inserts line breaks: every character it is fed comes out, in order,
so removing the inserted newlines gives back exactly the text the model produced.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable
from typing import TextIO

from freetoken.cli.display import text_width

__all__ = ["AnswerPrinter", "WordWrap"]

_DIM, _RESET = "\x1b[2m", "\x1b[0m"


def _is_wide(ch: str) -> bool:
    return unicodedata.east_asian_width(ch) in ("W", "F")


class WordWrap:
    """Streams text to `write`, breaking lines before words that would pass `width` columns.

    Words are held back until they end, so that a word is never split by a break; a word
    longer than a whole line is split at the width. Wide (CJK) characters may break
    anywhere, since those scripts have no spaces between words.
    """

    def __init__(self, write: Callable[[str], None], width: int | None) -> None:
        self.write = write
        self.width = width if width and width > 1 else None
        self.col = 0
        self.word = ""

    def feed(self, text: str) -> None:
        if self.width is None:
            self.write(text)
            return
        for ch in text:
            if ch == "\n":
                self.flush()
                self.write("\n")
                self.col = 0
            elif ch.isspace():
                self.flush()
                self.write(ch)
                self.col += 8 - self.col % 8 if ch == "\t" else 1
            elif _is_wide(ch):
                self.flush()
                self._place(ch)
            else:
                self.word += ch
                if text_width(self.word) >= self.width:
                    self.flush()

    def flush(self) -> None:
        if self.word:
            word, self.word = self.word, ""
            self._place(word)

    def _place(self, word: str) -> None:
        assert self.width is not None
        w = text_width(word)
        if self.col > 0 and self.col + w > self.width:
            self.write("\n")
            self.col = 0
        while w > self.width:
            cut, used = 0, 0
            while cut < len(word) and used + text_width(word[cut]) <= self.width:
                used += text_width(word[cut])
                cut += 1
            self.write(word[:cut] + "\n")
            word, w = word[cut:], text_width(word[cut:])
        self.write(word)
        self.col += w


class AnswerPrinter:
    """Feeds thinking and content deltas to the terminal in Ollama's layout.

    `Thinking...`, the reasoning and `...done thinking.` are dimmed (on a terminal), and
    the answer follows after a blank line.
    """

    def __init__(
        self,
        out: TextIO,
        *,
        width: int | None = None,
        color: bool = False,
        hide_thinking: bool = False,
    ) -> None:
        self.out = out
        self.color = color
        self.hide_thinking = hide_thinking
        self.wrap = WordWrap(self._emit, width)
        self.state: str | None = None
        self.last = "\n"

    def _emit(self, text: str) -> None:
        if text:
            self.out.write(text)
            self.last = text[-1]
            self.out.flush()

    def _style(self, code: str) -> None:
        # Escape codes bypass the wrapper so they never count as columns.
        if self.color:
            self.out.write(code)

    def _newline(self) -> None:
        self.wrap.flush()
        if self.last != "\n":
            self._emit("\n")
            self.wrap.col = 0

    def thinking(self, text: str) -> None:
        if self.hide_thinking or not text:
            return
        if self.state != "thinking":
            self._newline()
            self._style(_DIM)
            self._emit("Thinking...\n")
            self.state = "thinking"
        self.wrap.feed(text)

    def _end_thinking(self) -> None:
        self._newline()
        self._emit("...done thinking.\n\n")
        self._style(_RESET)
        self.state = None

    def content(self, text: str) -> None:
        if not text:
            return
        if self.state == "thinking":
            self._end_thinking()
        self.state = "content"
        self.wrap.feed(text)

    def finish(self) -> None:
        """Ends the answer on a fresh line with styles reset; safe to call after Ctrl-C."""
        if self.state == "thinking":
            self._end_thinking()
        self._newline()
        self.out.flush()
