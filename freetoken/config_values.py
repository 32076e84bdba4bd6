"""How settings' values are written: hosts, durations, sizes, booleans, lists, GPU sets,
and the checks each setting's parser applies. Pure parsing: nothing here reads the
environment (config.py does, and only it)."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# How routed experts that miss the GPU cache are served (the setting and the option).
MOE_POLICIES = ("adaptive", "resident", "lru-pcie", "cpu-misses", "static-layers")
ADAPTIVE_MODES = ("cache", "device", "split", "layers")  # moe/policy.py's Mode


@dataclass(frozen=True, slots=True)
class Setting:
    """One setting: its Config field, FREETOKEN_* variable, parser, default (parsed like a
    value set), one-line description, and any OLLAMA_* aliases."""

    field: str
    env: str
    parse: Callable[[str], Any]
    default: Any
    description: str
    aliases: tuple[str, ...] = ()


class ConfigError(ValueError):
    """A setting has a value that cannot be used."""


@dataclass(frozen=True, slots=True)
class Host:
    scheme: str
    host: str
    port: int

    @property
    def url(self) -> str:
        # Clients cannot connect to the wildcard address; they use loopback instead.
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        if ":" in host:
            host = f"[{host}]"
        return f"{self.scheme}://{host}:{self.port}"


def parse_host(value: str) -> Host:
    """Accepts `host`, `host:port`, `:port`, `scheme://host:port[/path]` like Ollama."""
    value = value.strip()
    scheme, port = "http", 11434
    m = re.match(r"^(https?)://(.*)$", value)
    if m:
        scheme, value = m.group(1), m.group(2)
        port = 443 if scheme == "https" else 80
    value = value.split("/", 1)[0]
    host = value
    m = re.match(r"^\[([^\]]*)\](?::(\d+))?$", value) or re.match(r"^([^:]*)(?::(\d+))?$", value)
    if not m:
        raise ValueError(f"cannot parse host {value!r}")
    host = m.group(1) or "127.0.0.1"
    if m.group(2):
        port = int(m.group(2))
    if not 0 < port < 65536:
        raise ValueError(f"port {port} out of range")
    return Host(scheme, host, port)


_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


# Go's largest time.Duration, in seconds: a keep_alive beyond it cannot be an expiry time.
MAX_DURATION_S = (2**63 - 1) / 1e9


def parse_duration(value: Any) -> float:
    """Seconds from a number (seconds) or a Go duration string ("5m", "1h30m", "-1").

    A negative result means "forever", as in Ollama's keep_alive. NaN and infinities are
    refused: they would become an expiry time nothing can print.
    """
    if isinstance(value, bool):
        raise ValueError(f"invalid duration {value!r}")
    if isinstance(value, (int, float)):
        return _finite_duration(float(value), value)
    text = str(value).strip()
    try:
        return _finite_duration(float(text), value)
    except ValueError as e:
        if "invalid duration" in str(e):
            raise
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    pos, total = 0, 0.0
    for m in _DURATION.finditer(body):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _UNIT_S[m.group(2)]
        pos = m.end()
    if pos != len(body) or not body:
        raise ValueError(f"invalid duration {value!r}")
    return sign * total


def _finite_duration(seconds: float, value: Any) -> float:
    if not math.isfinite(seconds):
        raise ValueError(f"invalid duration {value!r}")
    return seconds


def keep_alive_seconds(seconds: float) -> float:
    """A keep_alive as residency keeps it: longer than Go's largest duration is forever
    (negative), as a Go server's overflowing conversion makes it."""
    return -1.0 if seconds > MAX_DURATION_S else seconds


def parse_bool(value: str) -> bool:
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean, got {value!r}")


def parse_size(value: str) -> int:
    """Bytes from `123`, `8GiB`, `512MB`, `1.5G` (binary units for G/M/K)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B?)\s*", value, re.IGNORECASE)
    if not m:
        raise ValueError(f"expected a size like 8GiB, got {value!r}")
    scale = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[m.group(2).upper()]
    return int(float(m.group(1)) * scale)


def _choice(*names: str) -> Callable[[str], str]:
    def parse(value: str) -> str:
        v = value.strip().lower()
        if v not in names:
            raise ValueError(f"expected one of {', '.join(names)}, got {value!r}")
        return v

    return parse


def _nonneg_int(value: str) -> int:
    n = int(value)
    if n < 0:
        raise ValueError(f"expected a number >= 0, got {value!r}")
    return n


def _pos_int(value: str) -> int:
    n = int(value)
    if n <= 0:
        raise ValueError(f"expected a number > 0, got {value!r}")
    return n


def _fraction_or_auto(value: str) -> float | None:
    """A fraction in [0, 1), or "auto" (None: the caller derives one from measurements)."""
    v = value.strip().lower()
    if v == "auto":
        return None
    f = float(v)
    if not 0.0 <= f < 1.0:
        raise ValueError(f"expected auto or a fraction in [0, 1), got {value!r}")
    return f


def _team_parts(value: str) -> tuple[float, ...]:
    """A comma list of parts of a team, each in (0, 1], the first served first."""
    parts = tuple(float(v) for v in value.split(",") if v.strip())
    if not parts or not all(0.0 < f <= 1.0 for f in parts) or len(set(parts)) < len(parts):
        raise ValueError(f"expected distinct fractions in (0, 1], got {value!r}")
    return parts


def _adaptive_modes(value: str) -> tuple[str, ...] | None:
    """ "all" (None: every placement the machine allows) or a comma list of ADAPTIVE_MODES."""
    if value.strip().lower() == "all":
        return None
    modes = tuple(m.lower() for m in _csv(value))
    bad = [m for m in modes if m not in ADAPTIVE_MODES]
    if not modes or bad:
        raise ValueError(f"expected all or some of {', '.join(ADAPTIVE_MODES)}, got {value!r}")
    return modes


def _think_budgets(value: str) -> dict[str, int]:
    """ "low=1024,medium=4096,high=16384": thinking tokens per think level."""
    out = {}
    for part in _csv(value):
        level, eq, n = part.partition("=")
        level = level.strip().lower()
        if not eq or level not in ("low", "medium", "high", "max") or not n.strip().isdigit():
            raise ValueError(f"expected LEVEL=TOKENS pairs (low, medium, high, max), got {part!r}")
        out[level] = int(n)
    return out


def _csv(value: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in value.split(",") if p.strip())


def _gpus(value: str) -> str | tuple[int, ...]:
    """ "auto", a list of CUDA device indices ("0,1"), or "cpu:N" (N ranks on the CPU)."""
    v = value.strip().lower()
    if v == "auto":
        return v
    m = re.fullmatch(r"cpu:(\d+)", v)
    if m:
        if int(m.group(1)) < 1:
            raise ValueError(f"expected at least one CPU rank, got {value!r}")
        return f"cpu:{int(m.group(1))}"
    try:
        ids = tuple(int(p) for p in v.split(","))
    except ValueError:
        raise ValueError(
            f"expected auto, a list of GPU indices like 0,1, or cpu:N, got {value!r}"
        ) from None
    if any(i < 0 for i in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"expected distinct GPU indices >= 0, got {value!r}")
    return ids


def parse_registry(value: str) -> str:
    """A registry address as model names carry it (empty: Ollama's registry)."""
    v = value.strip().rstrip("/")
    if v and not re.fullmatch(r"(?:https?://)?[A-Za-z0-9_][A-Za-z0-9_.:-]*", v):
        raise ValueError(f"expected host[:port] or http(s)://host[:port], got {value!r}")
    return v


def _path(value: str) -> Path:
    return Path(value).expanduser()
