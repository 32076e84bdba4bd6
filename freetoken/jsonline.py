"""JSON for line-framed streams (NDJSON, SSE `data:` lines, the runner's events).

Compact and UTF-8 as Ollama writes it, with one difference from `json.dumps`: the three
characters other than the ASCII controls that `str.splitlines` breaks a line at (U+0085,
U+2028, U+2029) are written as escapes. Readers split a stream by that rule (httpx's
`iter_lines`, which the ollama Python client uses), and a model's text may hold any of
them: written raw, one answer's event reached the reader in two halves, neither of them
JSON. Escaped, the event decodes to the same text.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["dumps", "dumps_bytes"]

_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def dumps(obj: Any) -> str:
    """One line of JSON, with no character a line reader would break it at."""
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return text.translate(_BREAKS)


def dumps_bytes(obj: Any) -> bytes:
    """`dumps` in UTF-8; a lone surrogate (echoed from a request) becomes '?'."""
    return dumps(obj).encode("utf-8", "replace")
