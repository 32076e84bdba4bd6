"""Random JSON schemas for the randomised tests of constrained decoding: every keyword the
engine enforces (pattern, format, numeric bounds, multipleOf, lengths, enums, combinators,
$ref), in values a random-weight model finishes in a few dozen tokens (strings and arrays
bounded), and a checker of formats jsonschema leaves unchecked without extra packages."""

from __future__ import annotations

import datetime
import random
import re
from typing import Any

import jsonschema

PATTERNS = ["^[a-z]{2,5}$", "^[0-9]{3}-[0-9]{2}$", "^(red|green|blue)$", "^[A-Z][a-z]{0,4}$"]
FORMATS = ["date", "time", "date-time", "uuid", "ipv4", "email"]
_TIME = re.compile(r"\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)", re.I)


def _string(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(["plain", "pattern", "format"])
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(PATTERNS)}
    if kind == "format":
        fmt = rng.choice(FORMATS)
        return {"type": "string", "format": fmt, **({"maxLength": 24} if fmt == "email" else {})}
    low = rng.randint(0, 3)
    return {"type": "string", "minLength": low, "maxLength": low + rng.randint(0, 8)}


def _integer(rng: random.Random) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "integer"}
    low = rng.randint(-50, 50)
    if rng.random() < 0.7:
        out["exclusiveMinimum" if rng.random() < 0.3 else "minimum"] = low
    if rng.random() < 0.7:
        out["exclusiveMaximum" if rng.random() < 0.3 else "maximum"] = low + rng.randint(5, 500)
    if rng.random() < 0.3:
        out["multipleOf"] = rng.choice([2, 3, 5, 10])
    return out


def _number(rng: random.Random) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "number", "minimum": rng.choice([-10.5, 0, 1.25])}
    out["maximum"] = out["minimum"] + rng.choice([1, 7.5, 1000])
    if rng.random() < 0.3:
        out["multipleOf"] = rng.choice([0.5, 0.25])
    return out


def _leaf(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(["string", "string", "integer", "number", "enum", "const", "scalar"])
    if kind == "string":
        return _string(rng)
    if kind == "integer":
        return _integer(rng)
    if kind == "number":
        return _number(rng)
    if kind == "enum":
        return {"enum": rng.sample(["a", "b c", 1, 2.5, True, None, "日本"], rng.randint(1, 4))}
    if kind == "const":
        return {"const": rng.choice(["x", 7, False])}
    return {"type": rng.choice(["boolean", "null", ["boolean", "null"]])}


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """An object schema; nested objects, arrays and anyOf down to `depth` 2."""
    if depth > 0 and rng.random() < 0.5:
        return _leaf(rng)
    kind = rng.choice(["object", "object", "array", "anyOf"]) if depth else "object"
    if kind == "array":
        low = rng.randint(0, 1)
        items = random_schema(rng, depth + 1)
        return {"type": "array", "items": items, "minItems": low, "maxItems": low + 2}
    if kind == "anyOf":
        return {"anyOf": [_leaf(rng), random_schema(rng, depth + 1)]}
    names = rng.sample(["id", "name", "when", "tags", "score", "ok", "kind", "ip"], 4)
    props = {n: random_schema(rng, depth + 1) for n in names[: rng.randint(1, 4)]}
    required = [n for n in props if rng.random() < 0.7]
    return {"type": "object", "properties": props, "required": required}


def with_ref(schema: dict[str, Any]) -> dict[str, Any]:
    """The same schema with its first property moved into $defs behind a $ref."""
    props = dict(schema["properties"])
    first = next(iter(props))
    defs = {"part": props[first]}
    props[first] = {"$ref": "#/$defs/part"}
    return {**schema, "properties": props, "$defs": defs}


def _other_formats(value: Any, schema: Any) -> None:
    """Formats jsonschema's checker leaves alone without extra packages: time, date-time."""
    if isinstance(schema, dict):
        fmt = schema.get("format")
        if fmt == "time" and isinstance(value, str):
            assert _TIME.fullmatch(value), value
        if fmt == "date-time" and isinstance(value, str):
            day, _, time = value.partition("T") if "T" in value else value.partition("t")
            datetime.date.fromisoformat(day)
            assert _TIME.fullmatch(time), value


def validate(value: Any, schema: dict[str, Any]) -> None:
    """Validates with formats checked (and time / date-time by hand, where a string is)."""
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    jsonschema.validate(value, schema, format_checker=checker)
    _walk_formats(value, schema, schema)


def _walk_formats(value: Any, schema: Any, root: dict[str, Any]) -> None:
    if not isinstance(schema, dict):
        return
    if "$ref" in schema:
        schema = root["$defs"][schema["$ref"].rsplit("/", 1)[1]]
    _other_formats(value, schema)
    if isinstance(value, dict):
        for k, v in value.items():
            _walk_formats(v, (schema.get("properties") or {}).get(k), root)
    elif isinstance(value, list):
        for v in value:
            _walk_formats(v, schema.get("items"), root)
    for branch in schema.get("anyOf") or []:
        if jsonschema.Draft202012Validator(branch).is_valid(value):
            _walk_formats(value, branch, root)
            break
