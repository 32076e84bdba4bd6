"""The tokenizer's vocabulary as bytes, for the grammar engine and for logprobs.

`token_bytes` recovers the exact bytes each token stands for (byte-level BPE tokens may be
half a UTF-8 character, so decoding a token alone is not enough). `Vocab` holds them and
makes the grammar engine's view of the tokenizer: every token with its bytes, marker tokens
(chat formats' control tokens) as their text, so a grammar may write them, and the other
control tokens as special tokens no text matches.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection, Sequence
from typing import Any

import llguidance
import numpy as np

__all__ = ["Vocab", "token_bytes"]

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


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


class _Wrapped:
    """The tokenizer as llguidance's `TokenizerWrapper` contract reads it."""

    def __init__(self, vocab: Vocab, eos: int):
        self.eos_token_id, self.bos_token_id = eos, None
        self.tokens = vocab.bytes
        self.special_token_ids = [i for i, b in enumerate(vocab.bytes) if not b]
        self.is_tokenizer_wrapper = True
        self._encode = vocab.encode

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._encode(text)


class Vocab:
    """`bytes[i]` for each of `size` ids (the logits' width; ids past the tokenizer's are
    empty) and the tokenizer's `encode`, which forced text is tokenized with."""

    def __init__(
        self,
        data: Sequence[bytes],
        size: int,
        encode: Callable[[str], list[int]] | None = None,
    ):
        self.size = size
        self.bytes = list(data[:size]) + [b""] * max(0, size - len(data))
        self.encode = encode or self._greedy
        self._ids: dict[bytes, int] = {}
        for i, b in enumerate(self.bytes):
            self._ids.setdefault(b, i)
        self._longest = max((len(b) for b in self.bytes), default=1)
        # tokens of line breaks and spaces only (what may separate thinking from an answer)
        blank = [i for i, b in enumerate(self.bytes) if b and not b.strip(b" \n")]
        self.blank_ids = np.array(blank, dtype=np.int64)

    @classmethod
    def from_tokenizer(cls, tok: Any, size: int, markers: Collection[str] = ()) -> Vocab:
        """`markers`: texts of control tokens that are markup (chat formats' markers): they
        get their text's bytes, so a grammar may write them."""

        def encode(text: str) -> list[int]:
            return tok.encode(text, add_special_tokens=False).ids

        return cls(token_bytes(tok, markers), size, encode)

    def _greedy(self, text: str) -> list[int]:
        """Longest match first: the encoding of a vocabulary given as bytes alone."""
        data, out, i = text.encode(), [], 0
        while i < len(data):
            for n in range(min(self._longest, len(data) - i), 0, -1):
                tid = self._ids.get(data[i : i + n])
                if tid is not None and n:
                    out.append(tid)
                    i += n
                    break
            else:
                i += 1  # a byte no token holds: nothing can write it
        return out

    def grammar_tokenizer(self, eos_ids: Collection[int]) -> llguidance.LLTokenizer:
        """The vocabulary as the grammar engine sees it (about a second for 150k tokens)."""
        eos = sorted(eos_ids) or [0]
        return llguidance.LLTokenizer(_Wrapped(self, eos[0]), n_vocab=self.size, eos_token=eos)
