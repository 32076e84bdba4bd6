"""The schema-constrained JSON matcher: prefixes, completions, and random walks that must
always end in instances the `jsonschema` package accepts."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from freetoken.chat.jsonfsm import WS_MAX, Grammar, Matcher
from freetoken.chat.schema import ANY_OBJECT, SchemaError, compile_schema


def matcher(schema) -> Matcher:
    return Matcher(Grammar(ANY_OBJECT if schema == "json" else compile_schema(schema)))


def prefix_ok(schema, text: str) -> bool:
    m = matcher(schema)
    return bool(m.feed(m.initial(), text.encode()))


def complete(schema, text: str) -> bool:
    m = matcher(schema)
    state = m.feed(m.initial(), text.encode())
    return bool(state) and m.is_done(state)


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 5},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 2},
        "pet": {"type": ["string", "null"]},
    },
    "required": ["name", "age"],
}

CASES = [
    # (schema, complete instances, valid prefixes that are not complete, invalid texts)
    (
        PERSON,
        [
            '{"name": "Al", "age": 3}',
            '{"name":"Al","age":-30,"tags":["x"],"pet":null}',
            '{\n  "name": "é",\n  "age": 0\n}',
        ],
        [
            '{"name": "Al"',
            '{"name": "Al", "age": 3, "tags": [',
            '{"name": "Al", "age": 3, "tags": ["',
        ],
        [
            '{"age": 3, "name": "Al"}',
            '{"name": "", "age": 1}',
            '{"name": "abcdef", "age": 1}',
            '{"name": "Al"}',
            '{"name": "Al", "age": 1.5}',
            '{"name": "Al", "age": 01}',
            '{"name": "Al", "age": 1, "tags": []}',
            '{"name": "Al", "age": 1, "tags": ["a","b","c"]}',
            '{"name": "Al", "age": 1, "extra": 1}',
            '{"name": "Al", "age": 1,}',
            '{"name": "Al", "age": 1} ',
        ],
    ),
    (
        {"type": "number"},
        ["0", "-0", "12", "1.5", "1e10", "-2.5E-3"],
        ["-", "1.", "1e", "1e+"],
        ["01", "1.e3", ".5", "+1", "1ee", "NaN"],
    ),
    ({"type": "boolean"}, ["true", "false"], ["tr", "f"], ["True", "tru e", "null"]),
    ({"type": "null"}, ["null"], ["nu"], ["nil"]),
    (
        {"enum": ["red", 1, 12, None, [1, 2], {"a": True}]},
        ['"red"', "1", "12", "null", "[1, 2]", '{"a": true}'],
        ['"re', "[1"],
        ['"blue"', "2", "123", '"red" ', "[1,2]"],
    ),
    ({"const": 'x"y'}, ['"x\\"y"'], ['"x\\'], ['"xy"']),
    (
        {"type": "string"},
        ['"a\\n\\u00e9\\"b"', '"日本"', '"🙂"'],
        ['"\\u00'],
        ['"a\nb"', '"\\x"', '"\\u00g0"', '"abc'],
    ),
    (
        {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False},
        ['[1, "a"]', "[1]", "[]"],
        ["[1,"],
        ['[1, "a", 2]', '["a"]'],
    ),
    (
        {"type": "array", "items": {"type": "integer"}, "minItems": 2},
        ["[1,2]", "[1, 2, 3]"],
        ["[1"],
        ["[1]", "[]", "[1,]"],
    ),
    (
        {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"k": {"const": "a"}, "v": {"type": "string"}},
                    "required": ["k", "v"],
                },
                {
                    "type": "object",
                    "properties": {"k": {"const": "b"}, "v": {"type": "integer"}},
                    "required": ["k", "v"],
                },
            ]
        },
        ['{"k": "a", "v": "s"}', '{"k": "b", "v": 7}'],
        ['{"k": "b", "v": 7'],
        ['{"k": "a", "v": 7}', '{"k": "b", "v": "s"}', '{"k": "c", "v": 1}'],
    ),
    ({"oneOf": [{"type": "string"}, {"type": "integer"}]}, ['"s"', "3"], [], ["3.5", "true"]),
    (
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "additionalProperties": {"type": "boolean"},
        },
        ['{"a": 1, "b": true, "c": false}', '{"z": true}', "{}"],
        [],
        ['{"b": 1}', '{"a": 1, "a": 2}', '{"b": true, "b": false}', '{"b": true, "a": 1}'],
    ),
    ({"type": "object"}, ['{"any": [1, {"x": null}], "thing": "y"}', "{}"], [], ["[]", "1"]),
    (
        {
            "$defs": {
                "T": {
                    "type": "object",
                    "properties": {
                        "v": {"type": "integer"},
                        "kids": {"type": "array", "items": {"$ref": "#/$defs/T"}},
                    },
                    "required": ["v"],
                }
            },
            "$ref": "#/$defs/T",
        },
        ['{"v": 1, "kids": [{"v": 2, "kids": []}, {"v": 3}]}'],
        [],
        ['{"v": 1, "kids": [{}]}'],
    ),
    (
        {
            "allOf": [
                {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"properties": {"b": {"type": "string"}}, "required": ["b"]},
            ]
        },
        ['{"a": 1, "b": "x"}'],
        [],
        ['{"a": 1}', '{"b": "x"}'],
    ),
    ("json", ['{"a": [1, 2.5, "x", true, null, {}]}', "{}"], ['{"a":'], ["[1]", '"x"', "1"]),
    # a branch that cannot meet the sibling "type" is dropped, as a validator reads it
    (
        {"anyOf": [{"type": "string", "enum": ["x"]}, {"type": "null"}], "type": "string"},
        ['"x"'],
        ['"'],
        ["null", '"y"'],
    ),
    (
        {
            "anyOf": [{"$ref": "#/$defs/N"}, {"type": "integer"}],
            "type": ["integer", "string"],
            "$defs": {"N": {"type": "null"}},
        },
        ["3"],
        [],
        ["null", '"s"'],
    ),
]


@pytest.mark.parametrize("schema, good, prefixes, bad", CASES)
def test_instances_prefixes_and_rejections(schema, good, prefixes, bad):
    for text in good:
        assert complete(schema, text), text
        for cut in range(len(text.encode())):
            m = matcher(schema)
            assert m.feed(m.initial(), text.encode()[:cut]), (text, cut)
    for text in prefixes:
        assert prefix_ok(schema, text) and not complete(schema, text), text
    for text in bad:
        assert not complete(schema, text), text


def test_whitespace_is_bounded():
    m = matcher({"type": "array", "items": {"type": "integer"}})
    assert m.is_done(m.feed(m.initial(), b"[\n" + b" " * WS_MAX + b"1\n]"))
    assert not m.feed(m.initial(), b"[\n" + b" " * (WS_MAX + 1))
    assert not m.feed(m.initial(), b"[  1]")  # one space, or a newline and indentation
    assert not m.feed(m.initial(), b"[\n\n1]")


def test_numbers_are_bounded():
    m = matcher({"type": "integer"})
    assert m.feed(m.initial(), b"1" * 15)
    assert not m.feed(m.initial(), b"1" * 16)


def test_final_only_when_nothing_may_follow():
    m = matcher({"type": "object"})
    s = m.feed(m.initial(), b"{}")
    assert m.is_done(s) and m.is_final(s)
    n = matcher({"type": "integer"})
    s = n.feed(n.initial(), b"12")
    assert n.is_done(s) and not n.is_final(s)  # "12" may still grow


def test_utf8_split_across_tokens():
    m = matcher({"type": "string", "maxLength": 2})
    data = '"日本"'.encode()
    state = m.initial()
    for b in data:  # byte by byte, as tokens that end inside a character would feed it
        state = m.advance(state, b)
        assert state
    assert m.is_done(state)
    assert not m.feed(m.initial(), b'"\xe6"')  # a character cut short
    assert not m.feed(m.initial(), b'"\xff')


@pytest.mark.parametrize(
    "schema",
    [
        False,
        {"type": "nope"},
        {"enum": []},
        {"type": "array", "minItems": 3, "maxItems": 1},
        {"$ref": "#/$defs/missing"},
        {"$ref": "http://example.com/s.json"},
        {"type": "object", "properties": {"a": False}, "required": ["a"]},
        {"allOf": [{"type": "string"}, {"type": "integer"}]},
        {"anyOf": [{"type": "null"}, {"enum": [1]}], "type": "string"},  # no branch is left
        {"anyOf": [{"type": "nope"}, {"type": "string"}]},  # a broken branch is never dropped
    ],
)
def test_unusable_schemas_are_refused(schema):
    with pytest.raises(SchemaError):
        compile_schema(schema)


# -- random schemas, random walks ---------------------------------------------------------

_NAMES = ["a", "name", "x y", 'q"t', "é", "tab\t", "b\\s", "k9"]
_SCALARS = [0, 1, -2, 2.5, "s", "", "é", True, False, None]


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    kinds = ["string", "integer", "number", "boolean", "null", "enum", "const", "types"]
    if depth < 3:
        kinds += ["object", "object", "array", "array", "anyOf", "oneOf", "ref"]
    kind = rng.choice(["object", "object", "array"] if depth == 0 and rng.random() < 0.7 else kinds)
    if kind == "object":
        names = rng.sample(_NAMES, rng.randint(0, 4))
        s: dict = {
            "type": "object",
            "properties": {n: random_schema(rng, depth + 1) for n in names},
        }
        s["required"] = [n for n in names if rng.random() < 0.6]
        extra = rng.choice([None, None, True, False, "schema"])
        if extra == "schema":
            s["additionalProperties"] = random_schema(rng, depth + 1)
        elif extra is not None:
            s["additionalProperties"] = extra
        return s
    if kind == "array":
        s = {"type": "array", "items": random_schema(rng, depth + 1)}
        if rng.random() < 0.3:
            s["prefixItems"] = [random_schema(rng, depth + 1) for _ in range(rng.randint(1, 2))]
        lo = rng.choice([0, 0, 1, 2])
        if lo:
            s["minItems"] = lo
        if rng.random() < 0.4:
            s["maxItems"] = lo + rng.randint(0, 2)
        return s
    if kind == "string":
        s = {"type": "string"}
        if rng.random() < 0.4:
            s["minLength"] = rng.randint(0, 3)
        if rng.random() < 0.4:
            s["maxLength"] = s.get("minLength", 0) + rng.randint(0, 4)
        return s
    if kind == "enum":
        return {
            "enum": rng.sample(_SCALARS, rng.randint(1, 4))
            + ([[1, "a"]] if rng.random() < 0.2 else [])
        }
    if kind == "const":
        return {"const": rng.choice(_SCALARS + [{"k": [1]}])}
    if kind == "types":
        return {"type": rng.sample(["string", "integer", "boolean", "null"], 2)}
    if kind == "anyOf":
        return {"anyOf": [random_schema(rng, depth + 1) for _ in range(rng.randint(1, 3))]}
    if kind == "oneOf":  # alternatives of different types, so exactly one can hold
        types = rng.sample(["string", "integer", "boolean", "object", "array"], 2)
        return {"oneOf": [{"type": t} for t in types]}
    if kind == "ref":
        return {"$ref": "#/$defs/leaf"}
    return {"type": kind}


_CLOSERS = frozenset(b'"]}')


def random_walk(m: Matcher, rng: random.Random, limit: int = 4000) -> bytes | None:
    """Random allowed bytes until the value is complete (closing bytes are favoured so
    walks end); None if it ran past `limit`. Fails if a state ever allows nothing."""
    state, out = m.initial(), bytearray()
    while len(out) < limit:
        if m.is_done(state) and (m.is_final(state) or rng.random() < 0.3):
            return bytes(out)
        allowed = m.allowed_bytes(state)
        assert allowed, f"dead end after {bytes(out)!r}"
        weights = [
            8.0 if b in _CLOSERS else 0.3 if b in b" \n\t" else 0.05 if b >= 0x80 else 1.0
            for b in allowed
        ]
        b = rng.choices(allowed, weights)[0]
        out.append(b)
        state = m.advance(state, b)
    return None


@pytest.mark.parametrize("seed", range(100))
def test_random_walks_always_give_valid_instances(seed):
    rng = random.Random(seed)
    schema = random_schema(rng)
    schema["$defs"] = {"leaf": {"type": ["integer", "string"]}}
    m = matcher(schema)
    validator = jsonschema.Draft202012Validator(schema)
    finished = 0
    for _ in range(8):
        text = random_walk(m, rng)
        if text is None:
            continue
        finished += 1
        validator.validate(json.loads(text.decode("utf-8")))
    assert finished >= 6


@pytest.mark.parametrize("seed", range(10))
def test_random_walks_of_format_json_give_objects(seed):
    rng = random.Random(seed)
    m = matcher("json")
    text = random_walk(m, rng)
    assert text is not None and isinstance(json.loads(text.decode("utf-8")), dict)
