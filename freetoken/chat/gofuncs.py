"""The functions a Go template can call: text/template's builtins (`and`, `or`, `not`, `eq`,
`len`, `index`, `slice`, `print`, `printf`, ...) and the ones Ollama adds (`json`,
`currentDate`, `toTypeScriptType`). The evaluator runs `and` and `or` itself (LAZY), so
that they can stop before evaluating the operands they do not need.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from freetoken.chat.govalues import (
    Struct,
    format_float,
    format_v,
    go_json,
    go_quote,
    truth,
    type_name,
)

__all__ = ["FUNCS", "LAZY", "CallError", "Func", "sprintf"]

LAZY = frozenset({"and", "or"})


class CallError(Exception):
    """A template function failed; the evaluator adds where."""


@dataclass(frozen=True)
class Func:
    fn: Callable[..., Any]
    min_args: int
    max_args: int | None  # None: variadic


def _kind(v: Any) -> str | None:
    """Go's basic kind, with int and float numeric; None for nil."""
    if v is None:
        return None
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, (int, float)):
        return "number"
    return "string" if isinstance(v, str) else "other"


def _equal(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is None and b is None
    ka, kb = _kind(a), _kind(b)
    if ka != kb:
        raise CallError("incompatible types for comparison")
    if ka == "other":
        for v in (a, b):
            if isinstance(v, (list, tuple, dict)):
                raise CallError(f"non-comparable type {format_v(v)}: {type_name(v)}")
        return a is b
    return a == b


def _and(*args: Any) -> Any:
    return next((a for a in args if not truth(a)), args[-1])


def _or(*args: Any) -> Any:
    return next((a for a in args if truth(a)), args[-1])


def _eq(a: Any, *rest: Any) -> bool:
    return any(_equal(a, b) for b in rest)


def _ne(a: Any, b: Any) -> bool:
    return not _equal(a, b)


def _lt(a: Any, b: Any) -> bool:
    ka, kb = _kind(a), _kind(b)
    if ka not in ("number", "string") or kb not in ("number", "string"):
        raise CallError("invalid type for comparison")
    if ka != kb:
        raise CallError("incompatible types for comparison")
    return a < b


def _le(a: Any, b: Any) -> bool:
    return _lt(a, b) or _equal(a, b)


def _int(i: Any) -> int:
    if isinstance(i, bool) or not isinstance(i, int):
        raise CallError(f"cannot index slice/array with type {type_name(i)}")
    return i


def _len(v: Any) -> int:
    if v is None:
        raise CallError("len of nil pointer")
    if isinstance(v, str):
        return len(v.encode())  # Go counts bytes
    if isinstance(v, (list, tuple, dict)):
        return len(v)
    raise CallError(f"len of type {type_name(v)}")


def _index(item: Any, *keys: Any) -> Any:
    for key in keys:
        if item is None:
            raise CallError("index of untyped nil")
        if isinstance(item, dict):
            item = item.get(key)
            continue
        if not isinstance(item, (list, tuple, str)):
            raise CallError(f"can't index item of type {type_name(item)}")
        seq = item.encode() if isinstance(item, str) else item
        i = _int(key)
        if not 0 <= i < len(seq):
            raise CallError(f"index out of range: {i}")
        item = seq[i]
    return item


def _slice(item: Any, *idx: Any) -> Any:
    if item is None:
        raise CallError("slice of untyped nil")
    if not isinstance(item, (list, tuple, str)):
        raise CallError(f"can't slice item of type {type_name(item)}")
    if len(idx) > 3 or (len(idx) == 3 and isinstance(item, str)):
        raise CallError(f"too many slice indexes: {len(idx)}")
    seq = item.encode() if isinstance(item, str) else item
    bounds = [_int(i) for i in idx]
    for i in bounds:
        if not 0 <= i <= len(seq):
            raise CallError(f"index out of range: {i}")
    lo, hi = (bounds + [0, len(seq)][len(bounds) :])[:2]
    if lo > hi:
        raise CallError(f"invalid slice index: {lo} > {hi}")
    if len(bounds) == 3 and bounds[2] < hi:
        raise CallError(f"invalid slice index: {hi} > {bounds[2]}")
    if isinstance(item, str):
        return seq[lo:hi].decode("utf-8", "replace")
    return type(item)(item[lo:hi])


def _sprint(*args: Any) -> str:
    # fmt.Sprint: a space between operands only when neither is a string
    out = []
    for i, a in enumerate(args):
        if i and not isinstance(a, str) and not isinstance(args[i - 1], str):
            out.append(" ")
        out.append(format_v(a))
    return "".join(out)


def _sprintln(*args: Any) -> str:
    return " ".join(format_v(a) for a in args) + "\n"


def _json(v: Any) -> str:
    try:
        return go_json(v)
    except ValueError:
        return ""  # Ollama ignores encoding errors and prints nothing


def _current_date(*_: Any) -> str:
    return datetime.date.today().isoformat()


def _yesterday_date(*_: Any) -> str:
    return (datetime.date.today() - datetime.timedelta(days=1)).isoformat()


_TS_TYPES = {
    "string": "string",
    "number": "number",
    "integer": "number",
    "boolean": "boolean",
    "array": "any[]",
    "object": "Record<string, any>",
    "null": "null",
}


def _ts_property(p: Any) -> str:
    """A tool property's type as Ollama renders it: union of its types or its anyOf."""
    if not isinstance(p, dict):
        return "any"
    if isinstance(p.get("anyOf"), list) and p["anyOf"]:
        return " | ".join(_ts_property(x) for x in p["anyOf"])
    types = p.get("type")
    types = [types] if isinstance(types, str) else types
    if not isinstance(types, list) or not types:
        return "any"
    return " | ".join(_TS_TYPES.get(t, "any") for t in types)


def _ts_object(params: Any) -> str:
    props = params.get("properties") if isinstance(params, dict) else None
    if not isinstance(props, dict) or not props:
        return "{}"
    required = params.get("required") or []
    fields = []
    for name, p in props.items():
        key = name if name.isidentifier() else json.dumps(name)
        fields.append(f"{key}{'' if name in required else '?'}: {_ts_property(p)}")
    return "{ " + ", ".join(fields) + " }"


def _typescript(v: Any) -> str:
    # Ollama renders properties only; a whole parameters object (which it renders as
    # "any") becomes an object type here, so a template can print a signature in one call.
    if isinstance(v, Struct):
        if v.type_name == "ToolFunctionParameters":
            return _ts_object(v.wire)
        return _ts_property(v.wire) if v.type_name == "ToolProperty" else "any"
    return _ts_property(v)


_SIMPLE = {"s", "v", "d", "q", "t", "x", "X", "c", "T", "f", "F", "e", "E", "g", "G"}


def _format_one(verb: str, a: Any, prec: int | None, flags: str) -> str | None:
    """One printf verb applied to one value; None when Go would print %!verb(type=value)."""
    number = isinstance(a, (int, float)) and not isinstance(a, bool)
    if verb == "v" or (verb == "s" and not number and not isinstance(a, bool) and a is not None):
        text = format_v(a)
        return text[:prec] if prec is not None and isinstance(a, str) else text
    if verb == "T":
        return type_name(a)
    if verb == "t" and isinstance(a, bool):
        return "true" if a else "false"
    if verb == "q" and isinstance(a, str):
        return go_quote(a)
    if verb in "xX" and isinstance(a, str):
        hexed = a.encode().hex()
        return hexed if verb == "x" else hexed.upper()
    if number and isinstance(a, int) and verb in "dcqxX":
        char = chr(a) if 0 <= a <= 0x10FFFF else "\ufffd"
        if verb == "c":
            return char
        if verb == "q":
            inner = {'"': '"', "'": "\\'"}.get(char) or go_quote(char)[1:-1]
            return f"'{inner}'"
        return ("+" if "+" in flags and a >= 0 else "") + format(a, "d" if verb == "d" else verb)
    if number and verb in "fFeEgG":
        sign = "+" if "+" in flags else ""
        if verb in "gG" and prec is None:
            return (sign if a >= 0 else "") + format_float(float(a))
        return format(float(a), f"{sign}.{6 if prec is None else prec}{verb}")
    return None


def _printf(fmt: Any, *args: Any) -> str:
    if not isinstance(fmt, str):
        raise CallError(f"wrong type for value; expected string; got {type_name(fmt)}")
    return sprintf(fmt, *args)


_HTML = str.maketrans(
    {"&": "&amp;", "<": "&lt;", ">": "&gt;", "'": "&#39;", '"': "&#34;", "\0": "\ufffd"}
)


def _width(fmt: str, i: int) -> tuple[int | None, int]:
    j = i
    while j < len(fmt) and fmt[j].isdigit():
        j += 1
    return (int(fmt[i:j]) if j > i else None), j


def sprintf(fmt: str, *args: Any) -> str:
    """fmt.Sprintf for the common verbs, with Go's %!verb(...) for a wrong or missing value."""
    out: list[str] = []
    i, used = 0, 0
    while i < len(fmt):
        j = fmt.find("%", i)
        if j < 0:
            out.append(fmt[i:])
            break
        out.append(fmt[i:j])
        i = j + 1
        flags = ""
        while i < len(fmt) and fmt[i] in "-+# 0":
            flags += fmt[i]
            i += 1
        width, i = _width(fmt, i)
        prec = None
        if i < len(fmt) and fmt[i] == ".":
            prec, i = _width(fmt, i + 1)
            prec = prec or 0
        if i >= len(fmt):
            out.append("%!(NOVERB)")
            break
        verb = fmt[i]
        i += 1
        if verb == "%":
            out.append("%")
            continue
        if used >= len(args):
            out.append(f"%!{verb}(MISSING)")
            continue
        a = args[used]
        used += 1
        text = _format_one(verb, a, prec, flags) if verb in _SIMPLE else None
        if text is None:
            shown = "<nil>" if a is None else f"{type_name(a)}={format_v(a)}"
            text = f"%!{verb}({shown})"
        out.append(_pad(text, width, flags, isinstance(a, (int, float)) and verb != "s"))
    if used < len(args):
        extra = ", ".join(f"{type_name(a)}={format_v(a)}" for a in args[used:])
        out.append(f"%!(EXTRA {extra})")
    return "".join(out)


def _pad(text: str, width: int | None, flags: str, numeric: bool) -> str:
    if width is None or len(text) >= width:
        return text
    if "-" in flags:
        return text.ljust(width)
    if "0" in flags and numeric:
        sign = text[0] if text[:1] in "+-" else ""
        return sign + text[len(sign) :].rjust(width - len(sign), "0")
    return text.rjust(width)


FUNCS: dict[str, Func] = {
    "and": Func(_and, 1, None),
    "or": Func(_or, 1, None),
    "not": Func(lambda v: not truth(v), 1, 1),
    "eq": Func(_eq, 2, None),
    "ne": Func(_ne, 2, 2),
    "lt": Func(_lt, 2, 2),
    "le": Func(_le, 2, 2),
    "gt": Func(lambda a, b: not _le(a, b), 2, 2),
    "ge": Func(lambda a, b: not _lt(a, b), 2, 2),
    "len": Func(_len, 1, 1),
    "index": Func(_index, 1, None),
    "slice": Func(_slice, 1, None),
    "print": Func(_sprint, 0, None),
    "printf": Func(_printf, 1, None),
    "println": Func(_sprintln, 0, None),
    "html": Func(lambda *a: _sprint(*a).translate(_HTML), 0, None),
    "json": Func(_json, 1, 1),
    "currentDate": Func(_current_date, 0, None),
    "yesterdayDate": Func(_yesterday_date, 0, None),
    "toTypeScriptType": Func(_typescript, 1, 1),
}
