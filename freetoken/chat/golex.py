"""Go text/template, step 1: source text to tokens.

Text outside actions becomes one "text" token. An action is "open", its tokens, "close".
Trim markers (`{{- ` and ` -}}`) are applied here, to the neighbouring text, and comments
(`{{/* */}}`) produce nothing, so the parser never sees either.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from freetoken.chat.errors import TemplateError

__all__ = ["KEYWORDS", "Token", "error", "lex", "where"]

KEYWORDS = frozenset(
    {
        "block",
        "break",
        "continue",
        "define",
        "else",
        "end",
        "false",
        "if",
        "nil",
        "range",
        "template",
        "true",
        "with",
    }
)
_SPACE = " \t\r\n"
_PUNCT = {"|": "pipe", "(": "lparen", ")": "rparen", ",": "comma", "=": "assign"}
_ESCAPES = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v", "\\": "\\"}
_HEX_WIDTH = {"x": 2, "u": 4, "U": 8}
_HEX_DIGITS = "0123456789abcdefABCDEF"


class Token(NamedTuple):
    kind: str  # text open close field var dot ident keyword string number pipe lparen ...
    value: Any
    pos: int
    spaced: bool = False  # whitespace before it: a field after a space starts a new operand


def where(source: str, pos: int) -> str:
    line = source.count("\n", 0, pos) + 1
    column = pos - source.rfind("\n", 0, pos)
    return f"line {line}, column {column}"


def error(source: str, pos: int, message: str) -> TemplateError:
    return TemplateError(f"template: {where(source, pos)}: {message}")


def lex(source: str) -> list[Token]:
    return _Lexer(source).run()


def _is_space(s: str, i: int) -> bool:
    return i < len(s) and s[i] in _SPACE


def _is_word(c: str) -> bool:
    return c.isalnum() or c == "_"


class _Lexer:
    def __init__(self, source: str):
        self.src = source
        self.pos = 0
        self.out: list[Token] = []

    def run(self) -> list[Token]:
        src, trim = self.src, False
        while True:
            start = self.pos
            at = src.find("{{", start)
            text = src[start:] if at < 0 else src[start:at]
            if trim:
                text = text.lstrip(_SPACE)
            left_trim = at >= 0 and _is_space(src, at + 3) and src.startswith("-", at + 2)
            if left_trim:
                text = text.rstrip(_SPACE)
            if text:
                self.out.append(Token("text", text, start))
            if at < 0:
                break
            self.pos = at + (4 if left_trim else 2)
            trim = self._action(at)
        self.out.append(Token("eof", None, len(src)))
        return self.out

    def _close(self, p: int) -> int:
        """0: no closing delimiter at p; 1: `}}`; 2: ` -}}` (trims the text after it)."""
        if self.src.startswith("}}", p):
            return 1
        if _is_space(self.src, p) and self.src.startswith("-}}", p + 1):
            return 2
        return 0

    def _action(self, at: int) -> bool:
        """Lexes one action starting after its `{{`; returns whether it ends with ` -}}`."""
        src = self.src
        if src.startswith("/*", self.pos):
            return self._comment(at)
        self.out.append(Token("open", "{{", at))
        spaced = True
        while True:
            p = self.pos
            if p >= len(src):
                raise error(src, at, "unclosed action: missing }}")
            close = self._close(p)
            if close:
                self.out.append(Token("close", "}}", p))
                self.pos = p + (2 if close == 1 else 4)
                return close == 2
            if src[p] in _SPACE:
                self.pos += 1
                spaced = True
                continue
            self.out.append(self._token(p, spaced))
            spaced = False

    def _comment(self, at: int) -> bool:
        end = self.src.find("*/", self.pos + 2)
        if end < 0:
            raise error(self.src, at, "unclosed comment")
        close = self._close(end + 2)
        if not close:
            raise error(self.src, at, "comment ends before closing delimiter")
        self.pos = end + 2 + (2 if close == 1 else 4)
        return close == 2

    def _token(self, p: int, spaced: bool) -> Token:
        src, c = self.src, self.src[p]
        nxt = src[p + 1 : p + 2]
        if c == ":" and nxt == "=":
            self.pos = p + 2
            return Token("declare", ":=", p, spaced)
        if c in _PUNCT:
            self.pos = p + 1
            return Token(_PUNCT[c], c, p, spaced)
        if c in "\"`'":
            return self._quoted(p, spaced)
        if c == "$" or (c == "." and nxt and _is_word(nxt) and not nxt.isdigit()):
            q = p + 1
            while q < len(src) and _is_word(src[q]):
                q += 1
            self.pos = q
            if c == "$":
                return Token("var", src[p:q], p, spaced)
            return Token("field", src[p + 1 : q], p, spaced)
        if c.isdigit() or (c in "+-." and nxt[:1].isdigit()):
            return self._number(p, spaced)
        if c == ".":
            self.pos = p + 1
            return Token("dot", ".", p, spaced)
        if _is_word(c):
            q = p
            while q < len(src) and _is_word(src[q]):
                q += 1
            self.pos = q
            word = src[p:q]
            return Token("keyword" if word in KEYWORDS else "ident", word, p, spaced)
        raise error(src, p, f"unexpected {c!r} in action")

    def _quoted(self, p: int, spaced: bool) -> Token:
        src, quote = self.src, self.src[p]
        if quote == "`":
            end = src.find("`", p + 1)
            if end < 0:
                raise error(src, p, "unterminated raw quoted string")
            self.pos = end + 1
            return Token("string", src[p + 1 : end], p, spaced)
        q = p + 1
        while q < len(src) and src[q] != quote and src[q] != "\n":
            q += 2 if src[q] == "\\" else 1
        if q >= len(src) or src[q] != quote:
            raise error(src, p, "unterminated quoted string")
        self.pos = q + 1
        try:
            text = _unquote(src[p + 1 : q], quote)
        except ValueError as e:
            raise error(src, p, str(e)) from None
        if quote == '"':
            return Token("string", text, p, spaced)
        if len(text) != 1:
            raise error(src, p, f"malformed character constant: {src[p : q + 1]}")
        return Token("number", ord(text), p, spaced)

    def _number(self, p: int, spaced: bool) -> Token:
        src, q = self.src, p + 1
        while q < len(src) and (
            _is_word(src[q]) or src[q] == "." or (src[q] in "+-" and src[q - 1] in "eEpP")
        ):
            q += 1
        self.pos = q
        text = src[p:q]
        try:
            return Token("number", _number(text), p, spaced)
        except ValueError:
            raise error(src, p, f"bad number syntax: {text!r}") from None


def _number(text: str) -> int | float:
    clean = text.replace("_", "")
    body = clean.lstrip("+-").lower()
    if body.startswith("0x"):
        if "p" in body or "." in body:
            return float.fromhex(clean)
        return int(clean, 16)
    if any(c in body for c in ".ep"):
        # Go keeps such constants as float64 even when the value is whole (`1.0`, `1e3`).
        return float(clean)
    if len(body) > 1 and body[0] == "0" and body.isdigit():
        return int(clean, 8)
    return int(clean, 0)


def _unquote(body: str, quote: str) -> str:
    out: list[str] = []
    i = 0
    while i < len(body):
        c = body[i]
        if c != "\\":
            out.append(c)
            i += 1
            continue
        e = body[i + 1 : i + 2]
        if e in _ESCAPES or e == quote:
            out.append(_ESCAPES.get(e, e))
            i += 2
        elif e in _HEX_WIDTH:
            digits = body[i + 2 : i + 2 + _HEX_WIDTH[e]]
            if len(digits) != _HEX_WIDTH[e] or any(d not in _HEX_DIGITS for d in digits):
                raise ValueError(f"invalid escape \\{e}{digits}")
            out.append(chr(int(digits, 16)))
            i += 2 + len(digits)
        elif e and e in "01234567":
            digits = body[i + 1 : i + 4]
            if len(digits) != 3 or any(d not in "01234567" for d in digits):
                raise ValueError(f"invalid octal escape \\{digits}")
            out.append(chr(int(digits, 8)))
            i += 4
        else:
            raise ValueError(f"unknown escape sequence \\{e}")
    return "".join(out)
