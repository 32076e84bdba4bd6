"""Values as Go templates see them: truth, and how Go prints (`%v`), quotes (`%q`) and
JSON-encodes them. Plain Python values stand in for Go's: str, bool, int, float, None
(nil), list (slice), dict (map); `Struct` stands in for a Go struct.
"""

from __future__ import annotations

import math
from decimal import Decimal
from typing import Any

__all__ = [
    "JSONList",
    "JSONMap",
    "Struct",
    "format_float",
    "format_v",
    "go_json",
    "go_quote",
    "sorted_items",
    "truth",
    "type_name",
]


class Struct:
    """A Go struct. Reading a field it lacks is an error, as in Go. It prints and encodes
    as `wire` (its JSON form), as Ollama's tool types do through their String methods."""

    __slots__ = ("fields", "type_name", "wire")

    def __init__(self, type_name: str, fields: dict[str, Any], wire: Any = None):
        self.type_name = type_name
        self.fields = fields
        self.wire = wire

    def __repr__(self) -> str:
        return f"Struct({self.type_name}, {self.fields!r})"


class JSONMap(dict):
    """A Go map whose String method prints it as JSON (tool-call arguments, tool properties)."""


class JSONList(list):
    """A Go slice whose String method prints it as JSON (the tool list)."""


def truth(v: Any) -> bool:
    """Go's rule: false, 0, nil and empty strings, slices and maps are false; structs are true."""
    if v is None:
        return False
    if isinstance(v, (bool, int, float)):
        return v != 0
    if isinstance(v, (str, list, tuple, dict)):
        return len(v) > 0
    return True


def type_name(v: Any) -> str:
    if v is None:
        return "<nil>"
    if isinstance(v, Struct):
        return v.type_name
    for kind, name in (
        (bool, "bool"),
        (int, "int"),
        (float, "float64"),
        (str, "string"),
        ((list, tuple), "[]interface {}"),
        (dict, "map[string]interface {}"),
    ):
        if isinstance(v, kind):
            return name
    return type(v).__name__


def _key(k: Any) -> tuple[int, Any]:
    if isinstance(k, (int, float)) and not isinstance(k, bool):
        return (0, k)
    return (1, str(k))


def sorted_items(d: dict) -> list[tuple[Any, Any]]:
    """A Go map's items in the order Go visits them: sorted by key."""
    return sorted(d.items(), key=lambda kv: _key(kv[0]))


def format_v(v: Any) -> str:
    """Go's `%v`."""
    if v is None:
        return "<nil>"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return format_float(v)
    if isinstance(v, str):
        return v
    if isinstance(v, (Struct, JSONMap, JSONList)):
        return go_json(v)
    if isinstance(v, (list, tuple)):
        return "[" + " ".join(format_v(x) for x in v) + "]"
    if isinstance(v, dict):
        return "map[" + " ".join(f"{format_v(k)}:{format_v(x)}" for k, x in sorted_items(v)) + "]"
    return str(v)


def _shortest(f: float) -> tuple[str, int]:
    """The shortest digits that round-trip abs(f), and where the decimal point goes:
    abs(f) == 0.DIGITS × 10**point."""
    _, digits, exp = Decimal(repr(abs(f))).as_tuple()
    text = "".join(map(str, digits)).rstrip("0")
    assert isinstance(exp, int)
    return text, len(digits) + exp


def _plain(digits: str, point: int) -> str:
    if point <= 0:
        return "0." + "0" * -point + digits
    if point >= len(digits):
        return digits + "0" * (point - len(digits))
    return digits[:point] + "." + digits[point:]


def _scientific(digits: str, point: int, pad: int) -> str:
    exp = point - 1
    mantissa = digits[0] + ("." + digits[1:] if len(digits) > 1 else "")
    return f"{mantissa}e{'-' if exp < 0 else '+'}{abs(exp):0{pad}d}"


def format_float(f: float) -> str:
    """Go's `%v` for a float64: shortest digits, exponent form below 1e-4 or from 1e6 on."""
    if math.isnan(f):
        return "NaN"
    if math.isinf(f):
        return "+Inf" if f > 0 else "-Inf"
    if f == 0:
        return "0"
    digits, point = _shortest(f)
    sign = "-" if f < 0 else ""
    if point - 1 < -4 or point - 1 >= 6:
        return sign + _scientific(digits, point, 2)
    return sign + _plain(digits, point)


def _json_float(f: float) -> str:
    if not math.isfinite(f):
        raise ValueError(f"json: unsupported value: {format_float(f)}")
    if f == 0:
        return "0"
    digits, point = _shortest(f)
    sign = "-" if f < 0 else ""
    if abs(f) < 1e-6 or abs(f) >= 1e21:
        return sign + _scientific(digits, point, 1)
    return sign + _plain(digits, point)


# encoding/json's escaping: HTML-sensitive characters and line separators become \u escapes.
_JSON_ESCAPES = {ord(c): f"\\u{ord(c):04x}" for c in "<>&\u2028\u2029"}
_JSON_ESCAPES.update({i: f"\\u{i:04x}" for i in range(0x20)})
_JSON_ESCAPES.update(
    {
        ord(c): e
        for c, e in (
            ('"', '\\"'),
            ("\\", "\\\\"),
            ("\n", "\\n"),
            ("\r", "\\r"),
            ("\t", "\\t"),
            ("\b", "\\b"),
            ("\f", "\\f"),
        )
    }
)
_JSON_ESCAPES.update({i: "\ufffd" for i in range(0xD800, 0xE000)})


def _json(v: Any, out: list[str]) -> None:
    if isinstance(v, Struct):
        v = v.fields if v.wire is None else v.wire
    if v is None:
        out.append("null")
    elif isinstance(v, bool):
        out.append("true" if v else "false")
    elif isinstance(v, int):
        out.append(str(v))
    elif isinstance(v, float):
        out.append(_json_float(v))
    elif isinstance(v, str):
        out.append('"' + v.translate(_JSON_ESCAPES) + '"')
    elif isinstance(v, dict):
        out.append("{")
        for i, (k, x) in enumerate(v.items()):
            out.append("," if i else "")
            out.append('"' + format_v(k).translate(_JSON_ESCAPES) + '":')
            _json(x, out)
        out.append("}")
    elif isinstance(v, (list, tuple)):
        out.append("[")
        for i, x in enumerate(v):
            out.append("," if i else "")
            _json(x, out)
        out.append("]")
    else:
        raise ValueError(f"json: unsupported type: {type_name(v)}")


def go_json(v: Any) -> str:
    """encoding/json's compact form. Map keys stay in the order given (Go would sort them)."""
    out: list[str] = []
    _json(v, out)
    return "".join(out)


_QUOTE_ESCAPES = {
    "\a": "\\a",
    "\b": "\\b",
    "\f": "\\f",
    "\n": "\\n",
    "\r": "\\r",
    "\t": "\\t",
    "\v": "\\v",
    "\\": "\\\\",
    '"': '\\"',
}


def go_quote(s: str) -> str:
    """strconv.Quote: a double-quoted Go string literal."""
    out = ['"']
    for c in s:
        if c in _QUOTE_ESCAPES:
            out.append(_QUOTE_ESCAPES[c])
        elif c.isprintable():
            out.append(c)
        elif ord(c) < 0x80:
            out.append(f"\\x{ord(c):02x}")
        elif ord(c) < 0x10000:
            out.append(f"\\u{ord(c):04x}")
        else:
            out.append(f"\\U{ord(c):08x}")
    out.append('"')
    return "".join(out)
