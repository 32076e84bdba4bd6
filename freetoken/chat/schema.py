"""JSON Schema compiled into value nodes, the graph the incremental matcher (`jsonfsm`) walks.

Supported: `type` (one or a list), `object` with `properties` / `required` /
`additionalProperties`, `array` with `items` / `prefixItems` / `minItems` / `maxItems`,
`string` with `minLength` / `maxLength`, `number`, `integer`, `boolean`, `null`, `enum` and
`const` of any JSON value, `anyOf` / `oneOf` (both mean "one of these"; exclusivity is not
enforced), `allOf` (merged), and `$ref` to any local pointer (`#/$defs/...`, `#`), recursive
ones included. Keywords that do not constrain the shape (`pattern`, `format`, `minimum`,
`multipleOf`, ...) are accepted and not enforced.

Generation-minded choices:
- an object that lists `properties` and says nothing of `additionalProperties` takes no
  other keys (what a caller who wrote the schema expects, and llama.cpp's rule too);
- keys come in the order `properties` gives them (optional ones may be left out), so
  output follows the schema's order;
- `enum` / `const` values are written in one canonical form (`json.dumps`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ANY",
    "ANY_OBJECT",
    "Node",
    "Prop",
    "SchemaError",
    "compile_schema",
    "literal_node",
    "object_node",
    "union_node",
]


class SchemaError(ValueError):
    """A schema this compiler cannot turn into a grammar (or one no value satisfies)."""


class _NoValue(SchemaError):
    """A schema no value satisfies: an empty branch of an `anyOf`, not a broken schema."""


@dataclass(frozen=True)
class Prop:
    name: str
    key: bytes  # the key as written after its opening quote, closing quote included
    node: Node
    required: bool


@dataclass(eq=False)
class Node:
    """One kind of JSON value. Compared by identity: matcher states hold nodes."""

    kind: str  # any | object | array | string | number | integer | literal | union
    props: tuple[Prop, ...] = ()
    extra: Node | None = None  # the schema of keys not in props; None: no other keys
    first_req: tuple[int, ...] = ()  # for each prop index i, the first required index >= i
    index: dict[str, int] = field(default_factory=dict)  # prop name -> position
    prefix: tuple[Node, ...] = ()  # prefixItems
    items: Node | None = None  # items after the prefix; None: none
    min_items: int = 0
    max_items: int | None = None
    count_cap: int = 0  # items counted beyond this many make no difference
    min_len: int = 0
    max_len: int | None = None
    options: tuple[bytes, ...] = ()  # literal: the accepted serialisations
    optset: frozenset[bytes] = frozenset()
    alts: tuple[Node, ...] = ()  # union

    def item(self, i: int) -> Node | None:
        return self.prefix[i] if i < len(self.prefix) else self.items


def _key_bytes(name: str) -> bytes:
    return json.dumps(name, ensure_ascii=False).encode()[1:]


def literal_node(values: list[Any]) -> Node:
    opts = tuple(dict.fromkeys(json.dumps(v, ensure_ascii=False).encode() for v in values))
    if not opts:
        raise _NoValue("enum admits no value")
    return Node("literal", options=opts, optset=frozenset(opts))


def object_node(props: list[tuple[str, Node, bool]], extra: Node | None) -> Node:
    ps = tuple(Prop(n, _key_bytes(n), node, req) for n, node, req in props)
    first, nxt = [0] * (len(ps) + 1), len(ps)
    first[len(ps)] = nxt
    for i in range(len(ps) - 1, -1, -1):
        nxt = i if ps[i].required else nxt
        first[i] = nxt
    return Node(
        "object",
        props=ps,
        extra=extra,
        first_req=tuple(first),
        index={p.name: i for i, p in enumerate(ps)},
    )


def union_node(nodes: list[Node]) -> Node:
    flat: list[Node] = []
    for n in nodes:
        flat += n.alts if n.kind == "union" else [n]
    if not flat:
        raise _NoValue("anyOf admits no value")
    return flat[0] if len(flat) == 1 else Node("union", alts=tuple(flat))


ANY = Node("any")
ANY_OBJECT = object_node([], ANY)
ANY_ARRAY = Node("array", items=ANY)  # count_cap 0: every count is alike
ANY_STRING = Node("string")
ANY_NUMBER = Node("number")
ANY_SCALAR = literal_node([True, False, None])

_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")


def _is_type(value: Any, t: str) -> bool:
    if t == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if t == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    kinds = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}
    return isinstance(value, kinds[t])


def _as_list(t: Any) -> list[str]:
    return [t] if isinstance(t, str) else list(t)


def _meet(a: list[str], b: list[str]) -> list[str]:
    """The types both lists admit (an integer is a number)."""
    out = [t for t in a if t in b]
    if ("number" in a and "integer" in b) or ("integer" in a and "number" in b):
        out.append("integer")
    if not out:
        raise _NoValue("allOf admits no value: the types do not meet")
    return list(dict.fromkeys(out))


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Both schemas at once (allOf), for the keywords that combine simply."""
    out = dict(a)
    for k, v in b.items():
        if k not in out:
            out[k] = v
        elif k == "properties":
            props = dict(out[k])
            for name, sub in v.items():
                props[name] = {"allOf": [props[name], sub]} if name in props else sub
            out[k] = props
        elif k == "required":
            out[k] = list(dict.fromkeys([*out[k], *v]))
        elif k == "type":
            out[k] = _meet(_as_list(out[k]), _as_list(v))
        elif k == "enum":
            out[k] = [x for x in out[k] if x in v]
        elif k in ("minLength", "minItems"):
            out[k] = max(out[k], v)
        elif k in ("maxLength", "maxItems"):
            out[k] = min(out[k], v)
        elif (
            k in ("items", "additionalProperties")
            and isinstance(v, dict)
            and isinstance(out[k], dict)
        ):
            out[k] = {"allOf": [out[k], v]}
        else:
            out[k] = v
    return out


class _Compiler:
    def __init__(self, root: Any):
        self.root = root
        self.refs: dict[str, Node] = {}

    def resolve(self, ref: Any) -> Any:
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise SchemaError(f"unsupported $ref {ref!r}: only local references (#/...) are")
        target = self.root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and part in target:
                target = target[part]
            elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            else:
                raise SchemaError(f"$ref {ref!r} points nowhere")
        return target

    def ref(self, ref: str) -> Node:
        node = self.refs.get(ref)
        if node is None:
            # a placeholder first, so recursive references end at it
            node = self.refs[ref] = Node("pending")
            try:
                target = self.compile(self.resolve(ref))
            except SchemaError:
                del self.refs[ref]  # an anyOf may drop this branch and meet the ref again
                raise
            node.__dict__.update(target.__dict__)
        return node

    def deref(self, s: Any) -> Any:
        """A subschema with a top-level $ref replaced by what it points to (for merging)."""
        seen = 0
        while isinstance(s, dict) and "$ref" in s and seen < 32:
            rest = {k: v for k, v in s.items() if k != "$ref"}
            s = _merge(self.resolve(s["$ref"]), rest) if rest else self.resolve(s["$ref"])
            seen += 1
        return s

    def compile(self, s: Any) -> Node:
        if s is True or s == {}:
            return ANY
        if s is False:
            raise _NoValue("schema false admits no value")
        if not isinstance(s, dict):
            raise SchemaError(f"a schema must be an object or a boolean, not {type(s).__name__}")
        if "$ref" in s:
            return self.ref(s["$ref"])
        if "allOf" in s:
            merged = {k: v for k, v in s.items() if k != "allOf"}
            for part in s["allOf"]:
                merged = _merge(merged, self.deref(part) if part is not True else {})
            return self.compile(merged)
        for key in ("anyOf", "oneOf"):
            if key in s:
                return self.any_of(s, key)
        return self.typed(s)

    def any_of(self, s: dict[str, Any], key: str) -> Node:
        """The branches of `s[key]`, each met with the rest of `s`. A branch that admits no
        value once met is dropped: {"anyOf": [{"type": "string"}, {"type": "null"}], "type":
        "string"} is a string, as a validator would read it."""
        base = {k: v for k, v in s.items() if k != key}
        alts = s[key] if isinstance(s[key], list) else []
        nodes, empty = [], None
        for a in alts:
            try:
                nodes.append(self.compile(_merge(base, self.deref(a)) if base else a))
            except _NoValue as e:
                empty = e
        if not nodes and empty is not None:
            raise _NoValue(f"no branch of {key} admits a value ({empty})")
        return union_node(nodes)

    def typed(self, s: dict[str, Any]) -> Node:
        t = s.get("type")
        if "const" in s:
            return literal_node([s["const"]])
        if "enum" in s:
            values = s["enum"] if isinstance(s["enum"], list) else []
            if t is not None:
                values = [v for v in values if any(_is_type(v, x) for x in _as_list(t))]
            return literal_node(values)
        if isinstance(t, list):
            return union_node([self.typed({**s, "type": x}) for x in dict.fromkeys(t)])
        if t is None:
            if {"properties", "required", "additionalProperties"} & s.keys():
                t = "object"
            elif {"items", "prefixItems", "minItems", "maxItems"} & s.keys():
                t = "array"
            else:
                return ANY
        if t not in _TYPES:
            raise SchemaError(f"unknown type {t!r}")
        if t == "object":
            return self.object(s)
        if t == "array":
            return self.array(s)
        if t == "string":
            return self.string(s)
        if t in ("number", "integer"):
            return Node(t)
        return literal_node([True, False] if t == "boolean" else [None])

    def object(self, s: dict[str, Any]) -> Node:
        declared = s.get("properties") or {}
        required = [r for r in (s.get("required") or []) if isinstance(r, str)]
        addl = s.get("additionalProperties")
        if addl is None:
            extra = None if declared else ANY
        elif addl is False:
            extra = None
        else:
            extra = self.compile(addl)
        props: list[tuple[str, Node, bool]] = []
        for name, sub in declared.items():
            if sub is False:
                if name in required:
                    raise _NoValue(f"required property {name!r} admits no value")
                continue
            props.append((name, self.compile(sub), name in required))
        for name in required:
            if name not in declared:
                if extra is None:
                    raise _NoValue(f"required property {name!r} is not allowed")
                props.append((name, extra, True))
        return object_node(props, extra)

    def array(self, s: dict[str, Any]) -> Node:
        items = s.get("items", True)
        prefix_s = s.get("prefixItems") or []
        if isinstance(items, list):  # the older tuple form
            prefix_s, items = items, s.get("additionalItems", True)
        prefix = tuple(self.compile(x) for x in prefix_s)
        rest = None if items is False else self.compile(items)
        lo = int(s.get("minItems") or 0)
        hi = s.get("maxItems")
        hi = None if hi is None else int(hi)
        if rest is None:
            hi = len(prefix) if hi is None else min(hi, len(prefix))
        if hi is not None and lo > hi:
            raise _NoValue("minItems exceeds the items the array may hold")
        return Node(
            "array",
            prefix=prefix,
            items=rest,
            min_items=lo,
            max_items=hi,
            count_cap=max(len(prefix), lo, hi or 0),
        )

    def string(self, s: dict[str, Any]) -> Node:
        lo = int(s.get("minLength") or 0)
        hi = s.get("maxLength")
        hi = None if hi is None else int(hi)
        if hi is not None and lo > hi:
            raise _NoValue("minLength exceeds maxLength")
        return Node("string", min_len=lo, max_len=hi) if lo or hi is not None else ANY_STRING


def compile_schema(schema: Any) -> Node:
    """The value node for a JSON schema; raises SchemaError for what it cannot follow."""
    try:
        return _Compiler(schema).compile(schema)
    except RecursionError:
        raise SchemaError("schema is nested too deeply") from None
    except (TypeError, ValueError) as e:
        if isinstance(e, SchemaError):
            raise
        raise SchemaError(f"invalid schema: {e}") from None
