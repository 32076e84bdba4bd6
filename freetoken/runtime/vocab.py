"""The tokenizer's vocabulary as bytes, indexed for constrained decoding and logprobs.

`token_bytes` recovers the exact bytes each token stands for (byte-level BPE tokens may be
half a UTF-8 character, so decoding a token alone is not enough). `Trie` lays the tokens out
in a preorder array so a matcher can walk every token at once and skip a whole subtree at
the first byte it rejects. `Vocab` adds what makes free string content cheap: which tokens
are plain string content, as numpy vectors, so a mask inside a string is a vector
expression plus a walk over the few tokens that hold a quote or a backslash.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection
from typing import Any

import numpy as np

from freetoken.chat.jsonfsm import CLOSE, string_byte

__all__ = ["Trie", "Vocab", "token_bytes"]

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_ESCAPE_LETTERS = frozenset(b'"\\/bfnrt')


def _byte_level_table() -> dict[str, int]:
    """The inverse of the GPT-2 byte-to-character map that byte-level BPE vocabularies use:
    printable Latin-1 bytes stand for themselves, the others for code points from 256 on."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in keep}
    extra = 0
    for b in range(256):
        if b not in keep:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def _decoder_types(spec: Any) -> set[str]:
    if not isinstance(spec, dict):
        return set()
    found = {spec.get("type", "")}
    for sub in spec.get("decoders") or []:
        found |= _decoder_types(sub)
    return found


def token_bytes(tok: Any, shown: Collection[str] = ()) -> list[bytes]:
    """The bytes of every token id of a `tokenizers.Tokenizer`; b"" for control tokens
    (they are not text), except those whose text is in `shown` (chat formats' markers)."""
    spec = json.loads(tok.to_str())
    kinds = _decoder_types(spec.get("decoder"))
    out = [b""] * tok.get_vocab_size(with_added_tokens=True)
    table = _byte_level_table() if "ByteLevel" in kinds else None
    spiece = kinds & {"Metaspace", "ByteFallback", "Replace"}
    for text, i in tok.get_vocab(with_added_tokens=False).items():
        if i >= len(out):
            continue
        if table is not None and all(c in table for c in text):
            out[i] = bytes(table[c] for c in text)
        elif spiece:
            m = _BYTE_TOKEN.fullmatch(text)
            out[i] = bytes((int(m.group(1), 16),)) if m else text.replace("\u2581", " ").encode()
        else:
            s = tok.decode([i], skip_special_tokens=False)
            out[i] = b"" if "\ufffd" in s else s.encode()
    for i, added in tok.get_added_tokens_decoder().items():
        if i < len(out):
            hidden = added.special and added.content not in shown
            out[i] = b"" if hidden else added.content.encode()
    return out


class Trie:
    """Tokens by their bytes, in preorder: node i has `byte[i]` at `depth[i]`, its subtree
    ends before `end[i]`, and `tok[i]` is the token ending there (-1: none)."""

    def __init__(self, items: list[tuple[bytes, int]]):
        byte, depth, end, tok = [0], [0], [0], [-1]
        self.more: dict[int, list[int]] = {}  # further ids with the same bytes
        path = [0]  # the open nodes along the current token, by depth
        prev = b""
        for data, tid in sorted(items):
            common = 0
            limit = min(len(prev), len(data))
            while common < limit and prev[common] == data[common]:
                common += 1
            while len(path) > common + 1:
                end[path.pop()] = len(byte)
            for k in range(common, len(data)):
                path.append(len(byte))
                byte.append(data[k])
                depth.append(k + 1)
                end.append(0)
                tok.append(-1)
            node = path[len(data)]
            if tok[node] < 0:
                tok[node] = tid
            else:
                self.more.setdefault(node, []).append(tid)
            prev = data
        while path:
            end[path.pop()] = len(byte)
        self.byte, self.depth, self.end, self.tok = byte, depth, end, tok

    def __len__(self) -> int:
        return len(self.byte) - 1

    def children(self, node: int) -> list[int]:
        out, i = [], node + 1
        while i < self.end[node]:
            out.append(i)
            i = self.end[i]
        return out

    def walk(
        self, state: Any, advance: Callable[[Any, int], Any], out: list[int], node: int = 0
    ) -> int:
        """Appends to `out` every token whose bytes `advance` accepts from `state` (a falsy
        result rejects), of the whole trie or of the subtree under `node`; returns how many
        nodes it visited."""
        byte, depth, end, tok, more = self.byte, self.depth, self.end, self.tok, self.more
        states = [state] * (depth[node] + 1)
        if node:  # the subtree's own first byte
            states[-1] = advance(state, byte[node])
            if not states[-1]:
                return 1
            if tok[node] >= 0:
                out.append(tok[node])
                out += more.get(node, [])
        i, n, visited = node + 1, end[node], 1 if node else 0
        while i < n:
            visited += 1
            d = depth[i]
            s = advance(states[d - 1], byte[i])
            if not s:
                i = end[i]
                continue
            states[d:] = [s]
            t = tok[i]
            if t >= 0:
                out.append(t)
                if i in more:
                    out += more[i]
            i += 1
        return visited


def _string_shape(data: bytes) -> tuple[int, bool, int]:
    """A token read as JSON string content: (its leading continuation bytes, whether the rest
    is plain content (well-formed UTF-8, no quote, backslash or control byte), how many
    characters it begins)."""
    lead = 0
    while lead < len(data) and 0x80 <= data[lead] <= 0xBF:
        lead += 1
    pending = chars = 0
    for c in data[lead:]:
        r = string_byte(0, pending, c)
        if r is None or r == CLOSE or r[0]:
            return lead, False, 0
        pending, chars = r[1], chars + r[2]
    return lead, True, chars


class Vocab:
    """`bytes[i]` for each of `size` ids (the logits' width; ids past the tokenizer's are
    empty), a trie of all text tokens, and the vectors for string content."""

    def __init__(self, data: list[bytes], size: int, markers: frozenset[int] = frozenset()):
        self.size = size
        self.bytes = list(data[:size]) + [b""] * max(0, size - len(data))
        items = [(b, i) for i, b in enumerate(self.bytes) if b]
        self.trie = Trie(items)
        # tokens that may leave a string (or escape inside one) are walked one by one;
        # a marker token is markup, never string content (its parser would end the call)
        exits = [(b, i) for b, i in items if 0x22 in b or 0x5C in b]
        self.string_exits = Trie([(b, i) for b, i in exits if i not in markers])
        shapes = [
            (0, False, 0) if i in markers else _string_shape(b) for i, b in enumerate(self.bytes)
        ]
        self._lead = np.array([s[0] for s in shapes], dtype=np.int32)
        self._plain = np.array([s[1] for s in shapes], dtype=bool)
        self._chars = np.array([s[2] for s in shapes], dtype=np.int64)
        self._len = np.array([len(b) for b in self.bytes], dtype=np.int32)
        # after a backslash: an escape letter, then plain content
        tails = [
            _string_shape(b[1:])
            if b and b[0] in _ESCAPE_LETTERS and i not in markers
            else (1, False, 0)
            for i, b in enumerate(self.bytes)
        ]
        self._escaped = np.array([t[0] == 0 and t[1] for t in tails], dtype=bool)
        self._escaped_chars = np.array([t[2] for t in tails], dtype=np.int64)
        self._first = {self.trie.byte[i]: i for i in self.trie.children(0)}

    @classmethod
    def from_tokenizer(cls, tok: Any, size: int, markers: Collection[str] = ()) -> Vocab:
        """`markers`: texts of control tokens that are markup (chat formats' markers): they
        get their text's bytes, so a grammar may write them, but never inside a string."""
        ids = frozenset(i for m in markers if (i := tok.token_to_id(m)) is not None)
        return cls(token_bytes(tok, markers), size, ids)

    def escaped_content(self, remaining: int | None) -> np.ndarray:
        """Tokens that finish an escape (\\n, \\", ... but not \\uXXXX) and go on with plain
        content of at most `remaining` characters (None: any number)."""
        ok = self._escaped.copy()
        if remaining is not None:
            ok &= self._escaped_chars <= remaining
        return ok

    def subtrie(self, first: int) -> int | None:
        """The trie node of the tokens that begin with byte `first`."""
        return self._first.get(first)

    def string_content(self, pending: int, remaining: int | None) -> np.ndarray:
        """Tokens that are plain string content after `pending` (0..3) continuation bytes
        still due, beginning at most `remaining` characters (None: any number). A token
        holding a quote or a backslash is never included: `string_exits` are walked."""
        nonempty = self._len > 0
        if pending == 0:
            ok = (self._lead == 0) & self._plain & nonempty
        else:
            # the due bytes, then plain content; or a token of due bytes only
            whole = (self._lead == pending) & (self._len > pending) & self._plain
            part = (self._len <= pending) & (self._lead == self._len) & nonempty
            ok = whole | part
        if remaining is not None:
            ok &= self._chars <= remaining
        return ok
