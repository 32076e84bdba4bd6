"""Text formatting shared by the commands: tables, sizes, times and the `--verbose` stats.

Formats follow what Ollama's CLI prints, so scripts and eyes used to `ollama list` or
`ollama run --verbose` read ours the same way.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

__all__ = [
    "go_duration",
    "human_number",
    "human_size",
    "human_span",
    "parse_time",
    "processor",
    "relative_time",
    "stats_block",
    "table",
    "text_width",
    "until",
]

_SECOND = 1_000_000_000
_SIZE_UNITS = (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3))


def text_width(text: str) -> int:
    """Terminal columns `text` takes: wide (CJK) characters take two, combining marks none."""
    width = 0
    for ch in text:
        if unicodedata.combining(ch):
            continue
        width += 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1
    return width


def table(header: Sequence[str], rows: Iterable[Sequence[str]], gap: int = 4) -> str:
    rows = [list(map(str, r)) for r in rows]
    widths = [
        max((text_width(r[i]) for r in [list(header), *rows]), default=0)
        for i in range(len(header))
    ]
    lines = []
    for r in [list(header), *rows]:
        cells = [c + " " * (widths[i] - text_width(c) + gap) for i, c in enumerate(r)]
        lines.append("".join(cells).rstrip())
    return "\n".join(lines) + "\n"


def human_size(n: int | float) -> str:
    """Decimal units, like Ollama: `767 KB`, `1.2 GB`, `19 GB`."""
    unit, scale = next(((u, s) for u, s in _SIZE_UNITS if n >= s), ("B", 1))
    if scale == 1:
        return f"{int(n)} B"
    value = n / scale
    if value >= 10 or value == int(value):
        return f"{int(value)} {unit}"
    return f"{value:.1f} {unit}"


def human_number(n: int | float) -> str:
    """Parameter counts: `30.5B`, `8B`, `600M`."""
    for unit, scale in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale:
            text = f"{n / scale:.1f}"
            return (text[:-2] if text.endswith(".0") else text) + unit
    return str(int(n))


def _frac(value: int, unit: int) -> str:
    whole, part = divmod(value, unit)
    if not part:
        return str(whole)
    digits = len(str(unit)) - 1
    return f"{whole}.{part:0{digits}d}".rstrip("0")


def go_duration(ns: int | float) -> str:
    """A duration in nanoseconds written as Go's time.Duration prints it (`1.5s`, `12.5ms`)."""
    ns = int(ns)
    if ns == 0:
        return "0s"
    sign, ns = ("-" if ns < 0 else ""), abs(ns)
    if ns < 1_000:
        return f"{sign}{ns}ns"
    if ns < 1_000_000:
        return f"{sign}{_frac(ns, 1_000)}µs"
    if ns < _SECOND:
        return f"{sign}{_frac(ns, 1_000_000)}ms"
    hours, rest = divmod(ns, 3600 * _SECOND)
    minutes, rest = divmod(rest, 60 * _SECOND)
    seconds = _frac(rest, _SECOND) + "s"
    if hours:
        return f"{sign}{hours}h{minutes}m{seconds}"
    if minutes:
        return f"{sign}{minutes}m{seconds}"
    return sign + seconds


def human_span(seconds: float) -> str:
    """A rough length of time: `Less than a second`, `About a minute`, `3 days`."""
    s = abs(seconds)
    minutes, hours, days = s / 60, s / 3600, s / 86400
    if s < 1:
        return "Less than a second"
    if s < 2:
        return "1 second"
    if minutes < 1:
        return f"{int(s)} seconds"
    if minutes < 2:
        return "About a minute"
    if hours < 1:
        return f"{int(minutes)} minutes"
    if hours < 2:
        return "About an hour"
    if hours < 48:
        return f"{int(hours)} hours"
    if days < 14:
        return f"{int(days)} days"
    if days < 60:
        return f"{int(days // 7)} weeks"
    if days < 730:
        return f"{int(days // 30)} months"
    return f"{int(days // 365)} years"


def parse_time(value: Any) -> datetime | None:
    if not value or not isinstance(value, str):
        return None
    try:
        t = datetime.fromisoformat(value)
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=UTC)


def relative_time(t: datetime, now: datetime | None = None) -> str:
    now = now or datetime.now(UTC)
    delta = (t - now).total_seconds()
    text = human_span(delta)
    return f"{text} from now" if delta > 0 else f"{text} ago"


# keep_alive < 0 is sent back as a far-future expiry; anything this far out reads as forever.
_FOREVER_S = 10 * 365 * 86400


def until(expires_at: Any, now: datetime | None = None) -> str:
    """The UNTIL column of `ps`."""
    now = now or datetime.now(UTC)
    t = parse_time(expires_at)
    if t is None or t.year <= 1:
        return "Never"
    delta = (t - now).total_seconds()
    if delta <= 0:
        return "Stopping..."
    if delta >= _FOREVER_S:
        return "Forever"
    return relative_time(t, now)


def processor(size: int, size_vram: int) -> str:
    """Where a loaded model lives: `100% GPU`, `100% CPU` or `48%/52% CPU/GPU`."""
    if size <= 0 or size_vram <= 0:
        return "100% CPU"
    if size_vram >= size:
        return "100% GPU"
    cpu = round((size - size_vram) * 100 / size)
    return f"{cpu}%/{100 - cpu}% CPU/GPU"


def _rate(count: int, ns: int) -> str:
    return f"{count / (ns / _SECOND):.2f} tokens/s" if ns > 0 else "0.00 tokens/s"


def stats_block(m: Mapping[str, Any]) -> str:
    """Ollama's `--verbose` summary of a final response chunk."""

    def get(key: str) -> int:
        return int(m.get(key) or 0)

    rows = [
        ("total duration:", go_duration(get("total_duration"))),
        ("load duration:", go_duration(get("load_duration"))),
        ("prompt eval count:", f"{get('prompt_eval_count')} token(s)"),
        ("prompt eval duration:", go_duration(get("prompt_eval_duration"))),
        ("prompt eval rate:", _rate(get("prompt_eval_count"), get("prompt_eval_duration"))),
        ("eval count:", f"{get('eval_count')} token(s)"),
        ("eval duration:", go_duration(get("eval_duration"))),
        ("eval rate:", _rate(get("eval_count"), get("eval_duration"))),
    ]
    return "".join(f"{label:<22}{value}\n" for label, value in rows)
