"""A large byte-level vocabulary for benchmarks, the size of a production model's (Qwen's is
151,643 tokens), built in a few seconds without a download.

Its tokens are what such a vocabulary holds: the 256 bytes; words of the standard library's
sources with and without a leading space, capitalised and upper-cased, and their prefixes
and suffixes (BPE's fragments); numbers; runs of punctuation and whitespace (JSON's among
them); CJK characters. Text is tokenized longest match first, which is near what BPE gives
such a vocabulary.
"""

from __future__ import annotations

import itertools
import re
import sysconfig
from pathlib import Path
from typing import Any

from freetoken.tools.synth import MARKUP_TOKENS, SPECIAL_TOKENS

__all__ = ["pieces", "tokenizer", "write_tokenizer"]

_WORDS = re.compile(r"[^\W\d_]+", re.U)
_PUNCT = '{}[]":,.()<>=/\\-_ \n'


def _byte_char() -> dict[int, str]:
    """GPT-2's byte-to-character map (the one byte-level BPE vocabularies are written in)."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _words(count: int) -> list[str]:
    """`count` distinct words of the standard library's sources (read in name order)."""
    found: set[str] = set()
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        found.update(_WORDS.findall(path.read_text(encoding="utf-8", errors="replace")))
        if len(found) >= count:
            break
    return sorted(found, key=lambda w: (len(w), w))[:count]


def pieces(size: int) -> list[bytes]:
    """`size` distinct tokens' bytes (the first 256 are the single bytes)."""
    out: dict[bytes, None] = dict.fromkeys(bytes((b,)) for b in range(256))
    words = _words(size // 6)

    def add(texts: Any) -> None:
        for t in texts:
            if len(out) >= size:
                return
            out.setdefault(t.encode(), None)

    add(f"{s}{n}" for n in range(1000) for s in ("", " "))
    add(w for word in words for w in (word, " " + word, word.capitalize(), " " + word.upper()))
    add("".join(p) for n in (2, 3) for p in itertools.product(_PUNCT, repeat=n))
    add(chr(c) for c in range(0x4E00, 0x4E00 + 20000))
    add(w[:n] for w in words for n in range(2, len(w)))
    add(" " + w[:n] for w in words for n in range(2, len(w)))
    add(w[n:] for w in words for n in range(1, len(w) - 1))
    add(f" x{n}" for n in range(size))  # whatever is still missing
    return list(out)


def tokenizer(size: int) -> Any:
    """A `tokenizers.Tokenizer` of `size` byte-level tokens, then the synthetic models'
    special and markup tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    table = _byte_char()
    vocab = {"".join(table[b] for b in p): i for i, p in enumerate(pieces(size))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    return tok


def write_tokenizer(out: Path, size: int) -> Any:
    """tokenizer.json of `tokenizer(size)` in `out`; returns the tokenizer."""
    out.mkdir(parents=True, exist_ok=True)
    tok = tokenizer(size)
    tok.save(str(out / "tokenizer.json"))
    return tok
