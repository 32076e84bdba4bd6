"""Grammars of constrained decoding, written as the llguidance engine reads them: Lark text in
which a JSON value is `%json {schema}`. What an answer is held to is decided here and in
the chat formats (no torch, no vocabulary); the runner compiles the text against the model's
tokens (runtime/constrain.py).

JSON is written in one layout: `, ` between items, `: ` after a key and no other whitespace,
so a model cannot spend its tokens on newlines inside a value, and the text is what
`json.dumps` writes. Schemas are read as draft 2020-12, with three choices of ours:
- an object that lists `properties` and says nothing of `additionalProperties` takes no other
  keys (what a caller who wrote the schema expects, and llama.cpp's rule), except in an
  `allOf` branch, whose properties merge with its siblings';
- an integer without a bound on a side is held to JSON's interoperable range there, ±(2^53 −
  1) (RFC 8259: beyond it readers disagree), so digits cannot run on without end;
- a keyword the engine cannot enforce (`uniqueItems`, `not`, `if`, `contains`, a `oneOf`
  whose branches overlap, an unknown `format`, ...) makes the schema an error that names
  it. Only a tool offered to an answer that may call it (`auto`) is read leniently: its
  call is held to what can be enforced and the rest is not checked, since refusing the
  request would break every agent whose tool list holds one such schema.

Markers are written as text: the runner gives each marker token its text, so a grammar
that writes `<tool_call>` lets the model write the marker token (or spell it out).

Every grammar turns the engine's forcing off: where the grammar leaves one way to go, the
mask still holds every token that keeps the output valid (a token may run past the forced
text), not only the first token of the tokenizer's own reading of that text; the model's
distribution picks, and a mask is always what the grammar allows.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "FREE_TEXT",
    "JSON_LAYOUT",
    "Grammar",
    "Lark",
    "SchemaError",
    "explain",
    "json_format",
    "lit",
    "regex_lit",
    "schema_text",
    "invoke_section",
    "tagged_arguments",
    "until",
]

JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
FREE_TEXT = r"/(.|\n)*/"  # any text (special tokens are no text: they never match)
_HEADER = '%llguidance {"no_forcing": true}\n'

# keywords whose value is a schema, a list of schemas, or a map of names to schemas
_ONE = ("additionalProperties", "items", "contains", "not", "if", "then", "else")
_ONE += ("propertyNames", "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SAFE = 2**53 - 1  # the largest integer every JSON reader holds exactly


class SchemaError(ValueError):
    """A schema or tool choice that cannot become a grammar (the request is a 400)."""


@dataclass(frozen=True)
class Grammar:
    """Lark text for llguidance; `schemas` are the (label, schema text) pairs it embeds, to
    name the one at fault when the engine refuses it."""

    text: str
    schemas: tuple[tuple[str, str], ...] = ()


def lit(text: str) -> str:
    """A Lark string literal of `text`."""
    return json.dumps(text, ensure_ascii=False)


def regex_lit(text: str) -> str:
    """`text` matched literally inside a Lark `/regex/`."""
    return re.escape(text).replace("/", "\\/")


def until(text: str) -> str:
    """A lexeme of any text up to the first `text` (included): a lazy regex."""
    return f"/(.|\\n)*{regex_lit(text)}/"


def _closed(schema: Any, merged: bool = False) -> Any:
    """A copy of the schema in which objects that list properties take no other keys."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if isinstance(out.get(key), (dict, list)):
            out[key] = _closed(out[key])
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [_closed(s, key == "allOf") for s in out[key]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {k: _closed(v) for k, v in out[key].items()}
    if "properties" in out and "additionalProperties" not in out and not merged:
        out["additionalProperties"] = False
    if out.get("type") == "integer":
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -_SAFE
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = _SAFE
    return out


def schema_text(schema: Any, lenient: bool = False) -> str:
    """The schema as `%json` reads it: closed objects, the compact layout, and whether
    keywords the engine cannot enforce are errors (lenient: ignored)."""
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise SchemaError("a JSON schema must be an object")
    out = _closed(schema)
    out["x-guidance"] = {**JSON_LAYOUT, "lenient": lenient}
    return json.dumps(out, ensure_ascii=False)


def json_format(fmt: Any) -> Grammar:
    """The grammar of a request's `format`: "json" (any object) or a JSON schema."""
    if fmt == "json":
        fmt = {"type": "object"}
    elif not isinstance(fmt, dict):
        raise SchemaError('format must be "json" or a JSON schema object')
    text = schema_text(fmt)
    return Grammar(f"{_HEADER}start: %json {text}\n", (("format", text),))


_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[([^\]]*)\]")
_FORMAT = re.compile(r"Unknown format: (\S+)")


def explain(message: str) -> str:
    """An engine's refusal of a schema, as the 400 says it: the keyword it cannot enforce."""
    first = message.strip().splitlines()[0] if message.strip() else "invalid grammar"
    if m := _UNIMPLEMENTED.search(message):
        keys = ", ".join(k.strip().strip('"') for k in m.group(1).split(","))
        return f"schema keyword {keys} cannot be enforced by constrained decoding"
    if m := _FORMAT.search(message):
        return f'schema keyword format "{m.group(1)}" cannot be enforced (unknown format)'
    if "oneOf constraints are not supported" in message:
        return "schema keyword oneOf cannot be enforced: its branches overlap (use anyOf)"
    return f"invalid schema: {first[:300]}"


class Lark:
    """Rules of a grammar under construction, each under a fresh name."""

    def __init__(self) -> None:
        self.rules: list[str] = []
        self.schemas: list[tuple[str, str]] = []

    def rule(self, body: str, attrs: str = "") -> str:
        name = f"r{len(self.rules)}"
        self.rules.append(f"{name}{attrs}: {body}")
        return name

    def json(self, schema: Any, label: str, lenient: bool) -> str:
        """`%json` of the schema, remembered under `label` (to name it if it is refused)."""
        try:
            text = schema_text(schema, lenient)
        except SchemaError as e:
            raise SchemaError(f"{label}: {e}") from None
        self.schemas.append((label, text))
        return f"%json {text}"

    def grammar(self, start: str) -> Grammar:
        rules = "\n".join([f"start: {start}", *self.rules])
        return Grammar(f"{_HEADER}{rules}\n", tuple(self.schemas))


def _types(schema: Any) -> set[str]:
    if not isinstance(schema, Mapping):
        return set()
    t = schema.get("type")
    found = {t} if isinstance(t, str) else {x for x in t or [] if isinstance(x, str)}
    values = schema.get("enum", [schema["const"]] if "const" in schema else [])
    found |= {"string" for v in values if isinstance(v, str)}
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or []:
            found |= _types(sub)
    return found


# string keywords a value written as bare text can follow; the others cannot be checked
_BARE_OK = {"type", "enum", "const", "minLength", "maxLength", "title", "description"}
_BARE_OK |= {"default", "examples", "$comment", "deprecated", "readOnly", "writeOnly"}


def _unchecked(schema: Mapping[str, Any]) -> list[str]:
    """The keywords of a bare-text value's schema that text cannot be held to (the branches
    of a nullable string, `anyOf: [string, null]`, are read the same way)."""
    out = set()
    for key, value in schema.items():
        if key in ("anyOf", "oneOf") and isinstance(value, list):
            out |= {k for b in value if isinstance(b, Mapping) for k in _unchecked(b)}
        elif key not in _BARE_OK:
            out.add(key)
    return sorted(out)


def _bare_value(lark: Lark, schema: Any, close: str, label: str, lenient: bool) -> str:
    """A parameter written as text up to `close` (a string: where its type says "string")."""
    schema = schema if isinstance(schema, Mapping) else {}
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if isinstance(values, list) and values and all(isinstance(v, str) for v in values):
        return " | ".join(f"{lit(v + close)}" for v in values)
    others = _unchecked(schema)
    if others and not lenient:
        raise SchemaError(
            f"{label}: schema keyword {', '.join(others)} cannot be enforced on a value this "
            "model writes as bare text"
        )
    low, high = int(schema.get("minLength") or 0), schema.get("maxLength")
    count = "*" if not low and high is None else f"{{{low},{'' if high is None else high}}}"
    return lark.rule(f"/(.|\\n){count}{regex_lit(close)}/", "[lazy]")


def invoke_section(
    lark: Lark,
    tools: list[dict[str, Any]],
    *,
    head: Callable[[str], str],
    pair: Callable[[str, str, bool], str],
    close: tuple[str, str, str],
    lenient: bool,
    parallel: bool,
) -> str:
    """A rule for a section of XML-like invokes (MiniMax-M2's, DeepSeek-V4's DSML) after its
    open marker: `head(name)` opens one tool's invoke, `pair` writes a parameter (see
    tagged_arguments), `close` is (a parameter's close, an invoke's, the section's); with
    `parallel`, one invoke or more."""
    param_close, invoke_close, section_close = close
    alts = []
    for fn in tools:
        args = tagged_arguments(lark, fn, pair, param_close, lenient)
        alts.append(f'{lit(head(fn["name"]))} "\\n"? {args} {lit(invoke_close)}')
    invoke = lark.rule(" | ".join(f"({a})" for a in alts))
    more = f'("\\n"? {invoke})*' if parallel else ""
    return lark.rule(f'"\\n"? {invoke} {more} "\\n"? {lit(section_close)}')


def tagged_arguments(
    lark: Lark,
    fn: Mapping[str, Any],
    pair: Callable[[str, str, bool], str],
    close: str,
    lenient: bool,
) -> str:
    """A rule for a call's arguments written as one tagged pair per parameter (GLM's,
    MiniMax-M2's, Qwen3-Coder's and DeepSeek-V4's forms): `pair(key, value, text)` writes
    one from the key's text and a value rule that ends with `close`, `text` saying whether
    the value is bare text (strings) or JSON (every other value); parameters come in the
    schema's order, required ones always."""
    params = fn.get("parameters") if isinstance(fn.get("parameters"), Mapping) else {}
    props = params.get("properties") if isinstance(params.get("properties"), Mapping) else {}
    required = set(params.get("required") or [])
    name = fn["name"]
    parts = []
    for key, sub in props.items():
        label = f'tool "{name}" parameter "{key}"'
        if "string" in _types(sub):
            value, text = _bare_value(lark, sub, close, label, lenient), True
        else:
            value, text = f'{lark.json(sub, label, lenient)} "\\n"? {lit(close)}', False
        one = pair(lit(key), f"({value})", text)
        parts.append(one if key in required else f"({one})?")
    if params.get("additionalProperties", not props) is not False:
        # keys the schema does not list: any name, its value as text
        free = pair(r"/[^<>\n]+/", lark.rule(until(close), "[lazy]"), True)
        parts.append(f"({free})*")
    return lark.rule(" ".join(parts) if parts else '""')
