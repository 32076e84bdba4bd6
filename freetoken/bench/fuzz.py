"""Requests for fuzzing the API: every endpoint's schema as a valid body, the values and byte
sequences that broke it once (issue 22), and what an answer must look like.

`cases(rng)` generates requests: a valid body with one field replaced by a nasty value,
removed or joined by an unknown one, or the encoded body corrupted (a byte-order mark, cut
short, bytes that are not UTF-8, NaN spelled out, nesting hundreds deep). `verdict` says
what was wrong with an answer, if anything: a 5xx, an error that is not in the shape of
the API the path belongs to, a connection that was reset. The test suite drives the same
values through hypothesis (tests/api/test_fuzz.py); `freetoken bench soak fuzz` sends
thousands of them to a real server.

Bodies name scratch models (`fuzz-*`) and never the one the soak compares answers with:
a fuzz that deleted it would measure nothing.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CORRUPTIONS",
    "ENDPOINTS",
    "NASTY",
    "OPTION_VALUES",
    "Case",
    "Endpoint",
    "Raw",
    "case",
    "cases",
    "corrupt",
    "encode",
    "places",
    "replace",
    "verdict",
]

MODEL = "demo"  # the model every valid body names (the soak's reference model)
_MSG = [{"role": "user", "content": "hi"}]
_SHORT = {"num_predict": 4, "temperature": 0}
_TOOL = {
    "type": "function",
    "function": {"name": "f", "description": "d", "parameters": {"type": "object"}},
}


@dataclass(frozen=True)
class Raw:
    """A JSON token written as is (NaN, Infinity, 1e400): what json.dumps cannot spell."""

    text: str


@dataclass(frozen=True)
class Endpoint:
    method: str
    path: str
    body: dict[str, Any] | None = None  # a valid body; None: the route takes none

    @property
    def api(self) -> str:
        if self.path.startswith("/v1/messages"):
            return "anthropic"
        return "openai" if self.path.startswith("/v1/") else "ollama"


_DIGEST = "sha256:" + "0" * 64
ENDPOINTS: tuple[Endpoint, ...] = (
    Endpoint("POST", "/api/generate", {"model": MODEL, "prompt": "hi", "options": _SHORT}),
    Endpoint("POST", "/api/chat", {"model": MODEL, "messages": _MSG, "options": _SHORT}),
    Endpoint("POST", "/api/chat", {"model": MODEL, "messages": _MSG, "tools": [_TOOL]}),
    Endpoint("POST", "/api/embed", {"model": MODEL, "input": ["a", "b"]}),
    Endpoint("POST", "/api/embeddings", {"model": MODEL, "prompt": "a"}),
    Endpoint("POST", "/api/show", {"model": MODEL}),
    Endpoint(
        "POST",
        "/api/create",
        {"model": "fuzz-made", "from": MODEL, "system": "s", "parameters": {"top_k": 5}},
    ),
    Endpoint("POST", "/api/copy", {"source": MODEL, "destination": "fuzz-copy"}),
    Endpoint("DELETE", "/api/delete", {"model": "fuzz-copy"}),
    Endpoint("POST", "/api/pull", {"model": "fuzz-absent", "insecure": True, "stream": False}),
    # an absent model (a 404) unless a create or copy case made it; the registry is loopback
    Endpoint("POST", "/api/push", {"model": "fuzz-absent", "insecure": True, "stream": False}),
    Endpoint("POST", "/api/cache/resize", {"model": MODEL, "slots": 8}),
    Endpoint("POST", f"/api/blobs/{_DIGEST}", {"bytes": "not json: uploaded as they are"}),
    Endpoint("HEAD", f"/api/blobs/{_DIGEST}"),
    Endpoint("GET", "/api/version"),
    Endpoint("GET", "/api/tags"),
    Endpoint("GET", "/api/loading"),
    Endpoint("GET", "/api/ps"),
    Endpoint("GET", "/api/cache"),
    Endpoint("GET", "/v1/models"),
    Endpoint("GET", f"/v1/models/{MODEL}"),
    Endpoint(
        "POST",
        "/v1/chat/completions",
        {"model": MODEL, "messages": _MSG, "max_tokens": 4, "tools": [_TOOL], "seed": 1},
    ),
    Endpoint(
        "POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 4, "stop": ["x"]}
    ),
    Endpoint("POST", "/v1/embeddings", {"model": MODEL, "input": "a", "encoding_format": "float"}),
    Endpoint(
        "POST",
        "/v1/responses",
        {"model": MODEL, "input": "hi", "max_output_tokens": 4, "instructions": "be brief"},
    ),
    Endpoint(
        "POST",
        "/v1/messages",
        {"model": MODEL, "max_tokens": 4, "messages": _MSG, "system": "s", "top_k": 3},
    ),
    Endpoint("POST", "/v1/messages/count_tokens", {"model": MODEL, "messages": _MSG}),
)

# What broke the API once, or could: non-finite and huge numbers, integers past 64 bits,
# lone surrogates, wrong types, empty and long strings, nesting, garbage in every shape.
NASTY: tuple[Any, ...] = (
    Raw("NaN"),
    Raw("Infinity"),
    Raw("-Infinity"),
    Raw("1e400"),
    Raw("-1e400"),
    Raw('"\\ud800"'),
    Raw('"a\\udfffb"'),
    Raw("9" * 400),
    2**64,
    2**63,
    -(2**63) - 1,
    10**30,
    -1,
    0,
    1,
    1e-300,
    1e300,
    -0.5,
    2.5,
    "",
    "x" * 5000,
    "\u0000",
    "-1",
    "NaN",
    "1e400",
    "fuzz-absent",
    "../../etc/passwd",
    None,
    True,
    False,
    [],
    {},
    [1, 2],
    ["a", None],
    {"type": "nope"},
    {"type": "function", "function": "f"},
    {"$ref": "#/nope"},
    {"type": "object", "properties": [1]},
    [{"role": "wizard", "content": 1}],
    [{"role": "assistant", "tool_calls": [{"function": {"name": 1, "arguments": "x"}}]}],
    Raw("[" * 120 + "]" * 120),
)

# Options the sampler and loader have met badly, each tried where options go.
OPTION_VALUES: dict[str, tuple[Any, ...]] = {
    "temperature": (1e-300, 1e9, -1, Raw("NaN"), 1e39),
    "repeat_penalty": (0, -1.5, 1e38),
    "top_k": (-1, 0, 2**40),
    "top_p": (-1, 2, 0),
    "num_ctx": (1, 0, -5, 2**62, Raw("1e400")),
    "num_predict": (-2, -1, 0, 2**63),
    "seed": (2**64, -(2**63), -1),
    "stop": ([1], "", ["x" * 300]),
    "moe_policy": ("fastest", 3),
    "vram_budget": ("lots", "12GiB", -1),
    "num_keep": (-5, 10**9),
    "repeat_last_n": (-5, 10**9),
}


@dataclass
class Case:
    method: str
    path: str
    content: bytes | None
    api: str
    how: str  # what was done to the valid body (for the report)
    headers: dict[str, str] = field(default_factory=lambda: {"content-type": "application/json"})


def encode(body: Any) -> bytes:
    """JSON bytes of `body`, with each `Raw` token written as it is."""
    raws: list[str] = []

    def default(obj: Any) -> Any:
        if isinstance(obj, Raw):
            raws.append(obj.text)
            return f"\u0000raw{len(raws) - 1}\u0000"
        raise TypeError(type(obj).__name__)

    text = json.dumps(body, default=default, ensure_ascii=False)
    for i, raw in enumerate(raws):
        text = text.replace(json.dumps(f"\u0000raw{i}\u0000"), raw)
    return text.encode("utf-8", "surrogatepass")


def places(obj: Any, prefix: tuple = ()) -> list[tuple]:
    """Every place in a body a value can be put: dict keys and list indexes."""
    out = [prefix] if prefix else []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += places(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += places(v, (*prefix, i))
    return out


def replace(body: Any, path: tuple, value: Any, delete: bool = False) -> Any:
    """A copy of `body` with the value at `path` replaced (or removed)."""
    body = json.loads(json.dumps(body))
    node = body
    for key in path[:-1]:
        node = node[key]
    if delete:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return body


CORRUPTIONS = ("bom", "cut", "latin1", "trailing", "empty", "array", "deep", "utf16")


def corrupt(data: bytes, kind: str, rng: random.Random) -> bytes:
    """The encoded body spoiled in one of the ways of CORRUPTIONS."""
    if kind == "bom":
        return b"\xef\xbb\xbf" + data
    if kind == "cut":
        return data[: rng.randrange(max(1, len(data)))]
    if kind == "latin1":
        i = rng.randrange(max(1, len(data)))
        return data[:i] + b"\xff\xfe" + data[i:]
    if kind == "trailing":
        return data + b" }{"
    if kind == "empty":
        return b""
    if kind == "array":
        return b"[" + data + b"]"
    if kind == "deep":
        depth = rng.choice((150, 5000, 200_000))
        return b'{"model": ' + b"[" * depth + b"]" * depth + b"}"
    return data.decode("utf-8", "surrogatepass").encode("utf-16", "surrogatepass")


def _mutated(ep: Endpoint, rng: random.Random) -> tuple[Any, str]:
    body, roll = ep.body, rng.random()
    assert body is not None
    if roll < 0.08:
        return body, "valid"
    if roll < 0.25:
        name, values = rng.choice(sorted(OPTION_VALUES.items()))
        key = "options" if ep.api == "ollama" else None
        value = rng.choice(values)
        if key is None:  # the OpenAI and Anthropic spellings of options are top-level fields
            return {**body, name: value}, f"option {name}"
        return {**body, key: {**body.get(key, {}), name: value}}, f"option {name}"
    if roll < 0.35:
        return {**body, "keep_alive": rng.choice(NASTY + ("5m", -1, 0))}, "keep_alive"
    paths = places(body)
    if roll < 0.45 and paths:
        path = rng.choice(paths)
        return replace(body, path, None, delete=True), f"without {'.'.join(map(str, path))}"
    if roll < 0.5:
        key = rng.choice(("zz", "format", "context", "tools", "tool_choice", "response_format"))
        return {**body, key: rng.choice(NASTY)}, f"{key} added"
    path = rng.choice(paths)
    return replace(body, path, rng.choice(NASTY)), f"{'.'.join(map(str, path))} replaced"


def case(ep: Endpoint, rng: random.Random) -> Case:
    """One request to `ep`: its valid body changed in one way (or its bytes corrupted)."""
    if ep.body is None:
        return Case(ep.method, ep.path, None, ep.api, "no body")
    if ep.path.startswith("/api/blobs/"):
        data = rng.randbytes(rng.choice((0, 10, 5000)))
        return Case(ep.method, ep.path, data, ep.api, "blob", {})
    body, how = _mutated(ep, rng)
    data = encode(body)
    if rng.random() < 0.15:
        kind = rng.choice(CORRUPTIONS)
        data, how = corrupt(data, kind, rng), f"bytes: {kind}"
    return Case(ep.method, ep.path, data, ep.api, how)


def cases(rng: random.Random, n: int) -> Iterator[Case]:
    """`n` requests over every endpoint in turn (those with a body three times as often:
    a route without one has little to get wrong)."""
    turn = [ep for ep in ENDPOINTS for _ in range(3 if ep.body is not None else 1)]
    for i in range(n):
        yield case(turn[i % len(turn)], rng)


_ERROR_TYPES = {"anthropic": {400: "invalid_request_error", 404: "not_found_error"}}


def _error_shape(api: str, status: int, body: Any) -> bool:
    if api == "anthropic":
        err = body.get("error") if isinstance(body, dict) else None
        want = _ERROR_TYPES["anthropic"].get(status)
        return (
            body.get("type") == "error"
            and isinstance(err, dict)
            and isinstance(err.get("message"), str)
            and (want is None or err.get("type") == want)
        )
    if api == "openai":
        err = body.get("error") if isinstance(body, dict) else None
        # the four fields OpenAI's SDKs read; param and code may be null, never absent
        ok = isinstance(err, dict) and isinstance(err.get("message"), str)
        ok = ok and {"type", "param", "code"} <= set(err)
        return ok and (status != 400 or err.get("type") == "invalid_request_error")
    return isinstance(body, dict) and set(body) == {"error"} and isinstance(body["error"], str)


def verdict(c: Case, status: int, content_type: str, content: bytes) -> str | None:
    """What is wrong with an answer to `c` ("5xx", "shape"), or None when nothing is."""
    if status >= 500:
        return "5xx"
    if status < 400 or c.method == "HEAD":
        return None
    if not content_type.startswith("application/json"):
        return "shape"
    try:
        body = json.loads(content)
    except ValueError:
        return "shape"
    return None if _error_shape(c.api, status, body) else "shape"
