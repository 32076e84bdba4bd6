"""The one validator every request body passes: strict JSON, and the checks of values that
every API shares (integer ranges, tool definitions and tool calls).

Python's json module accepts what Go's decoder (and so Ollama) refuses: NaN and Infinity,
numbers that overflow to infinity, lone UTF-16 surrogates, a leading byte-order mark, and
nesting deep enough to exhaust the interpreter's stack. Each of those reached a handler as a
value nothing downstream expected, and came back as a 500 (or a reset connection). Here
they are refused as 400s, with Go's wording where Go has one.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import llguidance

from freetoken.api.errors import APIError
from freetoken.chat.grammar import SchemaError, explain, json_format

__all__ = [
    "INT64",
    "JSON_NAMES",
    "MAX_DEPTH",
    "check_format",
    "check_int",
    "check_tool_calls",
    "check_tools",
    "parse_json",
    "type_name",
]

MAX_DEPTH = 100  # tool schemas and messages nest a few levels; Go's limit is 10,000
INT64 = (-(2**63), 2**63 - 1)
_BOM = b"\xef\xbb\xbf"
# Longer than any 64-bit integer: parsed as a float, so no field takes it as an integer and
# Python's conversion limit on long digit strings is never reached.
_MAX_INT_DIGITS = 20
_TOO_DEEP = f"invalid request body: nested deeper than {MAX_DEPTH} levels"
_SURROGATE = re.compile("[\ud800-\udfff]")
JSON_NAMES = {
    str: "string",
    bool: "boolean",
    int: "number",
    float: "number",
    list: "array",
    dict: "object",
    type(None): "null",
}


class _Refused(ValueError):
    """Raised from inside the decoder's hooks: the message is the client's."""


def type_name(value: Any) -> str:
    return JSON_NAMES.get(type(value), type(value).__name__)


def _constant(name: str) -> Any:
    # Go reads NaN and Infinity as a stray letter; -Infinity as a letter inside a number.
    if name.startswith("-"):
        raise _Refused("invalid character 'I' in numeric literal")
    raise _Refused(f"invalid character {name[0]!r} looking for beginning of value")


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(f"json: cannot unmarshal number {text} into Go value of type float64")
    return value


def _int(text: str) -> int | float:
    if len(text.lstrip("-")) > _MAX_INT_DIGITS:
        return _float(text)
    return int(text)


def _go_syntax_error(e: json.JSONDecodeError) -> str:
    # The messages Go's encoding/json gives, which clients and users already know.
    rest = e.doc[e.pos :].strip()
    if not rest:
        return "unexpected EOF"
    c = e.doc[e.pos]
    if e.msg.startswith("Expecting value"):
        return f"invalid character {c!r} looking for beginning of value"
    if e.msg.startswith("Expecting property name"):
        return f"invalid character {c!r} looking for beginning of object key string"
    if e.msg.startswith("Extra data"):
        return f"invalid character {c!r} after top-level value"
    if e.msg.startswith("Expecting ':'"):
        return f"invalid character {c!r} after object key"
    if e.msg.startswith("Expecting ','"):
        return f"invalid character {c!r} after object key:value pair"
    if e.msg.startswith("Invalid control character"):
        return f"invalid character {c!r} in string literal"
    return f"invalid JSON: {e.msg} (offset {e.pos})"


def _decode(raw: bytes) -> str:
    if raw.startswith(_BOM):
        raise APIError(400, "invalid character 'ï' looking for beginning of value")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"invalid request body: not UTF-8 (byte {e.start})") from None


def _check_tree(obj: Any) -> None:
    """Depth and lone surrogates, walked without recursion (a deep body is the attack)."""
    todo: list[tuple[Any, int]] = [(obj, 1)]
    while todo:
        node, depth = todo.pop()
        if isinstance(node, str):
            if _SURROGATE.search(node):
                raise APIError(400, "invalid request body: a string holds a lone UTF-16 surrogate")
            continue
        if not isinstance(node, (dict, list)):
            continue
        if depth > MAX_DEPTH:
            raise APIError(400, _TOO_DEEP)
        if isinstance(node, dict):
            todo.extend((k, depth) for k in node)
            todo.extend((v, depth + 1) for v in node.values())
        else:
            todo.extend((v, depth + 1) for v in node)


def parse_json(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object, as strictly as Go reads it; 400 for anything else."""
    if not raw.strip():
        raise APIError(400, "missing request body")
    text = _decode(raw)
    try:
        obj = json.loads(text, parse_constant=_constant, parse_float=_float, parse_int=_int)
    except json.JSONDecodeError as e:
        raise APIError(400, _go_syntax_error(e)) from None
    except _Refused as e:
        raise APIError(400, str(e)) from None
    except RecursionError:
        raise APIError(400, _TOO_DEEP) from None
    _check_tree(obj)
    if not isinstance(obj, dict):
        raise APIError(400, f"cannot unmarshal {type_name(obj)} into a request object")
    return obj


def check_int(name: str, value: int, low: int = INT64[0], high: int = INT64[1]) -> int:
    """`value` if it lies in [low, high] (by default a Go int's range); else 400."""
    if not low <= value <= high:
        raise APIError(400, f'invalid value for "{name}": number {value} is out of range')
    return value


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise APIError(
            400, f'invalid value for "{where}": cannot unmarshal {type_name(value)} into object'
        )
    return value


def _string(obj: dict[str, Any], key: str, where: str, required: bool = False) -> None:
    value = obj.get(key)
    if value is None and not required:
        return
    if not isinstance(value, str) or (required and not value):
        got = "an empty string" if value == "" else type_name(value)
        raise APIError(400, f'invalid value for "{where}.{key}": expected a string, got {got}')


def check_tools(tools: list[Any], where: str = "tools") -> list[dict[str, Any]]:
    """Function tools as Ollama and OpenAI write them: `{"type": "function", "function":
    {"name", "description"?, "parameters"?}}`; anything else is a 400 naming the place."""
    for i, raw in enumerate(tools):
        at = f"{where}[{i}]"
        tool = _object(raw, at)
        kind = tool.get("type", "function")
        if kind != "function":
            raise APIError(400, f'invalid value for "{at}.type": {kind!r} (only "function")')
        fn = _object(tool.get("function"), f"{at}.function")
        _string(fn, "name", f"{at}.function", required=True)
        _string(fn, "description", f"{at}.function")
        if fn.get("parameters") is not None:
            _object(fn["parameters"], f"{at}.function.parameters")
    return tools


def check_tool_calls(calls: list[Any], where: str) -> list[dict[str, Any]]:
    """Earlier tool calls in a history: `{"function": {"name", "arguments": {...}}}`."""
    for i, raw in enumerate(calls):
        at = f"{where}[{i}]"
        fn = _object(_object(raw, at).get("function"), f"{at}.function")
        _string(fn, "name", f"{at}.function")
        if fn.get("arguments") is not None:
            _object(fn["arguments"], f"{at}.function.arguments")
    return calls


def check_format(fmt: Any) -> Any:
    """A `format` JSON schema the runner can hold an answer to, compiled here once (by the
    grammar engine, without a vocabulary) so that a schema it cannot (a `$ref` that points
    nowhere, `properties` that are not an object, a keyword it cannot enforce) is this
    request's 400 before any runner is involved, in the words the runner would use."""
    if not isinstance(fmt, dict):
        return fmt
    try:
        for label, text in json_format(fmt).schemas:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(text)
            if err := llguidance.LLMatcher.validate_grammar(grammar):
                raise APIError(400, f"{label}: {explain(err)}")
    except SchemaError as e:
        raise APIError(400, f"format: {e}") from None
    except (TypeError, ValueError, RecursionError) as e:
        # the compiler met a shape it does not expect: the schema's fault, not the server's
        raise APIError(400, f"format: not a usable JSON schema ({e})") from None
    return fmt
