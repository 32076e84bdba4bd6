"""The Ollama wire contract: request dataclasses parsed from JSON, and response builders.

Field names and defaults follow Ollama's `api/types.go`. Parsing checks each field's JSON
type and raises `APIError(400, ...)` with a message naming the field; unknown fields are
ignored, as Go's decoder ignores them.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from freetoken import config
from freetoken import options as opts
from freetoken.api.errors import APIError
from freetoken.protocol import ProtocolError, check_think

__all__ = [
    "ChatRequest",
    "EmbedRequest",
    "EmbeddingsRequest",
    "GenerateRequest",
    "field_of",
    "chat_chunk",
    "generate_chunk",
    "metrics",
    "now",
    "parse_json",
    "reduce_chat",
    "reduce_generate",
]

_ROLES = ("system", "user", "assistant", "tool")
_JSON_NAMES = {
    str: "string",
    bool: "boolean",
    int: "number",
    float: "number",
    list: "array",
    dict: "object",
    type(None): "null",
}


def now() -> str:
    """RFC3339 with nanoseconds in UTC, as Go's time.RFC3339Nano writes it."""
    ns = time.time_ns()
    secs, frac = divmod(ns, 1_000_000_000)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(secs))
    digits = f"{frac:09d}".rstrip("0")
    return f"{stamp}.{digits}Z" if digits else f"{stamp}Z"


def _json_error(e: json.JSONDecodeError) -> str:
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
    return f"invalid JSON: {e.msg} (offset {e.pos})"


def parse_json(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object; 400 for an empty or malformed body."""
    if not raw.strip():
        raise APIError(400, "missing request body")
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        raise APIError(400, _json_error(e)) from None
    except UnicodeDecodeError:
        raise APIError(400, "invalid request body: not UTF-8") from None
    if not isinstance(obj, dict):
        raise APIError(
            400, f"cannot unmarshal {_JSON_NAMES.get(type(obj), 'value')} into a request object"
        )
    return obj


def field_of(
    body: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = None
) -> Any:
    """`body[name]` if it has the JSON type `kind` (null means absent); else 400."""
    value = body.get(name)
    if value is None:
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
    if not ok:
        want = " or ".join(dict.fromkeys(_JSON_NAMES[k] for k in kinds))
        got = _JSON_NAMES.get(type(value), type(value).__name__)
        raise APIError(400, f'invalid value for "{name}": cannot unmarshal {got} into {want}')
    return value


def _model(body: dict[str, Any]) -> str:
    if value := field_of(body, "model", str, ""):
        return value
    raise APIError(400, "model is required")


def _keep_alive(body: dict[str, Any]) -> float | None:
    value = field_of(body, "keep_alive", (int, float, str))
    if value is None:
        return None
    try:
        return config.parse_duration(value)
    except ValueError:
        raise APIError(400, f'time: invalid duration "{value}"') from None


def _think(body: dict[str, Any]) -> bool | str | None:
    try:
        return check_think(field_of(body, "think", (bool, str)))
    except ProtocolError as e:
        raise APIError(400, str(e)) from None


def _format(body: dict[str, Any]) -> str | dict[str, Any] | None:
    value = body.get("format")
    if value in (None, ""):
        return None
    if value == "json" or isinstance(value, dict):
        return value
    raise APIError(400, 'invalid format: expected "json" or a JSON schema')


def _top_logprobs(body: dict[str, Any]) -> int:
    value = field_of(body, "top_logprobs", int, 0)
    if not 0 <= value <= 20:
        raise APIError(400, "top_logprobs must be between 0 and 20")
    return value


def _options(body: dict[str, Any]) -> dict[str, Any]:
    try:
        return opts.validate(body.get("options"))
    except opts.OptionError as e:
        raise APIError(400, str(e)) from None


def _message(m: Any) -> dict[str, Any]:
    if not isinstance(m, dict):
        raise APIError(400, "invalid message: expected an object")
    role = field_of(m, "role", str, "").lower()
    if role not in _ROLES:
        raise APIError(400, f'invalid message role "{role}"')
    out = {k: v for k, v in m.items() if v is not None}
    out["role"] = role
    out["content"] = field_of(m, "content", str, "")
    return out


@dataclass
class _Common:
    """What generate and chat share."""

    model: str
    stream: bool = True
    format: str | dict[str, Any] | None = None
    keep_alive: float | None = None  # seconds; negative is forever, None the server default
    options: dict[str, Any] = field(default_factory=dict)
    think: bool | str | None = None
    truncate: bool | None = None
    logprobs: bool = False
    top_logprobs: int = 0  # alternatives listed per token (0..20)

    @staticmethod
    def common(body: dict[str, Any]) -> dict[str, Any]:
        return {
            "model": _model(body),
            "stream": field_of(body, "stream", bool, True),
            "format": _format(body),
            "keep_alive": _keep_alive(body),
            "options": _options(body),
            "think": _think(body),
            "truncate": field_of(body, "truncate", bool),
            "logprobs": field_of(body, "logprobs", bool, False),
            "top_logprobs": _top_logprobs(body),
        }

    def runner_fields(self) -> dict[str, Any]:
        """Runner request fields beyond the body builders' (logprobs, when asked for)."""
        if not self.logprobs and not self.top_logprobs:
            return {}
        return {"logprobs": True, "top_logprobs": self.top_logprobs}


@dataclass
class GenerateRequest(_Common):
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False
    images: list[str] | None = None

    @classmethod
    def parse(cls, body: dict[str, Any]) -> GenerateRequest:
        context = field_of(body, "context", list)
        if context is not None and not all(
            isinstance(t, int) and not isinstance(t, bool) for t in context
        ):
            raise APIError(400, 'invalid value for "context": expected an array of integers')
        req = cls(
            **cls.common(body),
            prompt=field_of(body, "prompt", str, ""),
            suffix=field_of(body, "suffix", str),
            system=field_of(body, "system", str),
            template=field_of(body, "template", str),
            context=context,
            raw=field_of(body, "raw", bool, False),
            images=field_of(body, "images", list) or None,
        )
        if req.raw and (req.template or req.system or req.context):
            raise APIError(400, "raw mode does not support template, system, or context")
        return req

    def runner_fields(self) -> dict[str, Any]:
        # images go to the runner, which refuses them for a model that reads only text
        return super().runner_fields() | ({"images": self.images} if self.images else {})


@dataclass
class ChatRequest(_Common):
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[Any] | None = None

    @classmethod
    def parse(cls, body: dict[str, Any]) -> ChatRequest:
        return cls(
            **cls.common(body),
            messages=[_message(m) for m in field_of(body, "messages", list, [])],
            tools=field_of(body, "tools", list) or None,
        )


def _embed_input(value: Any) -> list[str]:
    """`input`: a string (none when empty) or a list of strings."""
    if value is None or value == "":
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise APIError(400, "invalid input type")


@dataclass
class EmbedRequest:
    """POST /api/embed."""

    model: str
    input: list[str] = field(default_factory=list)
    truncate: bool = True  # cut inputs to num_ctx; false: an over-long input is a 400
    dimensions: int | None = None  # keep the first n components (then re-normalise)
    keep_alive: float | None = None
    options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, body: dict[str, Any]) -> EmbedRequest:
        dims = field_of(body, "dimensions", int)
        if dims is not None and dims < 0:
            raise APIError(400, "dimensions must be a positive integer")
        return cls(
            model=_model(body),
            input=_embed_input(body.get("input")),
            truncate=field_of(body, "truncate", bool, True),
            dimensions=dims or None,
            keep_alive=_keep_alive(body),
            options=_options(body),
        )


@dataclass
class EmbeddingsRequest:
    """POST /api/embeddings (the older, single-prompt form)."""

    model: str
    prompt: str = ""
    keep_alive: float | None = None
    options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, body: dict[str, Any]) -> EmbeddingsRequest:
        return cls(
            model=_model(body),
            prompt=field_of(body, "prompt", str, ""),
            keep_alive=_keep_alive(body),
            options=_options(body),
        )


# -- responses ---------------------------------------------------------------------------


def metrics(done: dict[str, Any], total_ns: int, load_ns: int) -> dict[str, Any]:
    """The final chunk's counters, integer nanoseconds like Go's time.Duration."""
    return {
        "total_duration": int(total_ns),
        "load_duration": int(load_ns),
        "prompt_eval_count": int(done.get("prompt_eval_count") or 0),
        "prompt_eval_duration": int(done.get("prompt_eval_duration") or 0),
        "prompt_cached_count": int(done.get("prompt_cached_count") or 0),
        "eval_count": int(done.get("eval_count") or 0),
        "eval_duration": int(done.get("eval_duration") or 0),
    }


def generate_chunk(model: str, event: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "model": model,
        "created_at": now(),
        "response": event.get("content", ""),
    }
    if event.get("thinking"):
        out["thinking"] = event["thinking"]
    if event.get("tool_calls"):
        out["tool_calls"] = event["tool_calls"]
    out["done"] = False
    if event.get("logprobs"):
        out["logprobs"] = event["logprobs"]
    return out


def chat_chunk(model: str, event: dict[str, Any]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": event.get("content", "")}
    if event.get("thinking"):
        message["thinking"] = event["thinking"]
    if event.get("tool_calls"):
        message["tool_calls"] = event["tool_calls"]
    out = {"model": model, "created_at": now(), "message": message, "done": False}
    if event.get("logprobs"):
        out["logprobs"] = event["logprobs"]
    return out


def _joined(chunks: list[dict[str, Any]], key: str) -> str:
    return "".join(c.get(key) or "" for c in chunks)


def reduce_generate(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """stream:false: one object with the concatenated response and the final fields."""
    out = dict(chunks[-1])
    out["response"] = _joined(chunks, "response")
    if thinking := _joined(chunks, "thinking"):
        out["thinking"] = thinking
    calls = [c for ch in chunks for c in ch.get("tool_calls") or []]
    if calls:
        out["tool_calls"] = calls
    return _with_logprobs(out, chunks)


def _with_logprobs(out: dict[str, Any], chunks: list[dict[str, Any]]) -> dict[str, Any]:
    logprobs = [lp for c in chunks for lp in c.get("logprobs") or []]
    if logprobs:
        out["logprobs"] = logprobs
    return out


def reduce_chat(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    out = dict(chunks[-1])
    messages = [c["message"] for c in chunks]
    message: dict[str, Any] = {"role": "assistant", "content": _joined(messages, "content")}
    if thinking := _joined(messages, "thinking"):
        message["thinking"] = thinking
    calls = [c for m in messages for c in m.get("tool_calls") or []]
    if calls:
        message["tool_calls"] = calls
    out["message"] = message
    return _with_logprobs(out, chunks)
