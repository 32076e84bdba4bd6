"""The runner protocol: what the server asks a runner for and what the runner streams back.

Torch-free, shared by the API layer (which builds requests) and the runtime (which serves
them), so both sides agree on one typed definition. On the wire a request is a JSON object
with these field names (docs/architecture.md, "The runner protocol"); `from_json` is the one
place a runner checks what it was sent. The server has already merged the options (request >
Modelfile PARAMETERs > defaults), checked the request against the model's capabilities and
chosen the system prompt.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, TypedDict

from freetoken import options as opts

__all__ = [
    "THINK_LEVELS",
    "CompletionRequest",
    "Done",
    "Event",
    "ProtocolError",
    "check_think",
    "error_event",
    "template_level",
]

KINDS = ("chat", "generate")
MAX_TOP_LOGPROBS = 20
# `think` as a level (Ollama's); "max" is the most a model offers ("high" where that is
# its most)
THINK_LEVELS = ("low", "medium", "high", "max")


class ProtocolError(ValueError):
    """A request the runner cannot serve as sent (the runner answers 400 with the message)."""


def check_think(value: bool | str | None) -> bool | str | None:
    """`think` as sent: a bool, a level of THINK_LEVELS, or None (the model's default).
    The one check of a level: the API's fields and the runner's requests both come here."""
    if isinstance(value, str) and value not in THINK_LEVELS:
        raise ProtocolError(
            f'invalid think value "{value}" (must be true, false, "low", "medium", "high" or "max")'
        )
    return value


def template_level(think: bool | str | None) -> str | None:
    """The level a template that takes one (`reasoning_effort`) is given: None for a bool
    (the template's own default), "high" for "max" (templates know low, medium, high)."""
    if not isinstance(think, str):
        return None
    return "high" if think == "max" else think


# JSON field -> the types it may hold (None: null, which means absent)
_TYPES: dict[str, tuple[type, ...]] = {
    "kind": (str,),
    "messages": (list,),
    "prompt": (str,),
    "suffix": (str,),
    "system": (str,),
    "raw": (bool,),
    "template": (str,),
    "tools": (list,),
    "think": (bool, str),
    "format": (str, dict),
    "context": (list,),
    "truncate": (bool,),
    "options": (dict,),
    "tool_choice": (str, dict),
    "logprobs": (bool,),
    "top_logprobs": (int,),
    "images": (list,),
    "stream_tool_calls": (bool,),
    "think_budget": (int,),
    "parallel_tool_calls": (bool,),
}


# fields beyond what Ollama's generate and chat carry: on the wire only where they are set
_EXTRAS = frozenset(
    {"tool_choice", "logprobs", "top_logprobs", "images", "think_budget", "parallel_tool_calls"}
)


@dataclass(frozen=True)
class CompletionRequest:
    """POST /completion (and /tokenize, which counts the same request's prompt)."""

    kind: str = "chat"  # "chat": `messages`; "generate": `prompt` (and `suffix`, `system`)
    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None
    suffix: str | None = None
    system: str | None = None
    raw: bool = False  # generate without the template
    template: str | None = None  # the Modelfile TEMPLATE; None: the tokenizer's chat template
    tools: list[Any] | None = None
    think: bool | str | None = None  # None: on where the template supports thinking
    format: str | dict[str, Any] | None = None  # "json" or a JSON schema
    context: list[int] | None = None  # a generate's earlier context, as token ids
    truncate: bool = True  # False: a prompt longer than num_ctx is refused
    options: dict[str, Any] = field(default_factory=dict)  # merged and checked (options.py)
    tool_choice: str | dict[str, Any] | None = None  # "auto", "none", "required" or a function
    logprobs: bool = False
    top_logprobs: int = 0  # alternatives listed per token
    images: list[Any] | None = None
    stream_tool_calls: bool = False  # also stream a call's arguments as they grow
    # thinking tokens at most (None: no bound); the server sets it from Anthropic's
    # budget_tokens or the think level's budget, so the runner needs no settings of its own
    think_budget: int | None = None
    # False: an answer holds one call at most; True: a forced answer may hold several too;
    # None (the client said nothing): a forced answer is one call, an `auto` one any number
    parallel_tool_calls: bool | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ProtocolError(f"invalid kind {self.kind!r} (one of {', '.join(KINDS)})")
        check_think(self.think)
        if self.think_budget is not None and self.think_budget < 1:
            raise ProtocolError("think_budget must be a positive number of tokens")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ProtocolError(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}")
        if self.context is not None and not all(
            isinstance(i, int) and not isinstance(i, bool) for i in self.context
        ):
            raise ProtocolError("context must be a list of token ids")

    @property
    def is_generate(self) -> bool:
        return self.kind == "generate"

    @property
    def wants_logprobs(self) -> int | None:
        """How many alternatives each token's logprobs list (None: no logprobs)."""
        return self.top_logprobs if self.logprobs or self.top_logprobs else None

    def replace(self, **changes: Any) -> CompletionRequest:
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        """Every field of Ollama's requests, and FreeToken's own only where they are set."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name not in _EXTRAS or value != f.default:
                out[f.name] = value
        return out

    @classmethod
    def from_json(cls, body: Any) -> CompletionRequest:
        """The request in `body`; unknown fields are ignored, a wrong type is refused with
        the field's name, and the options are checked by their declared types."""
        if not isinstance(body, dict):
            raise ProtocolError("request body must be a JSON object")
        values: dict[str, Any] = {}
        for name, kinds in _TYPES.items():
            value = body.get(name)
            if value is None:
                continue
            if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
                raise ProtocolError(f"invalid value for {name!r}: {value!r}")
            values[name] = value
        try:
            values["options"] = opts.validate(values.get("options"))
        except opts.OptionError as e:
            raise ProtocolError(str(e)) from None
        return cls(**values)


class Event(TypedDict, total=False):
    """One streamed event (NDJSON line) before the last: any of these keys."""

    content: str  # a piece of the answer
    thinking: str  # a piece of the model's reasoning
    tool_calls: list[dict[str, Any]]  # whole calls: [{"function": {"name", "arguments"}}]
    tool_call_start: dict[str, Any]  # {"index", "name"}: a call's arguments begin streaming
    tool_call_delta: dict[str, Any]  # {"index", "arguments"}: more of its argument text
    # {"index", "name", "arguments"}: a call the token limit cut, its argument text as far
    # as it got (never a whole call, never content)
    tool_call_truncated: dict[str, Any]
    streamed: bool  # on a whole call whose arguments were streamed as deltas
    logprobs: list[dict[str, Any]]  # of the tokens behind this event
    error: str  # the request failed after streaming began: the last event


@dataclass(frozen=True)
class Done:
    """The last event of a request that ended normally."""

    done_reason: str  # "stop" | "length"
    prompt_eval_count: int  # prompt tokens evaluated (those the prefix cache held are not)
    prompt_eval_duration: int  # ns, from submission to the first token
    eval_count: int  # generated tokens
    eval_duration: int  # ns, from the first token to the last
    context: list[int]  # prompt and output token ids
    prompt_cached_count: int = 0  # prompt tokens taken from the prefix cache (ours)

    def to_json(self) -> dict[str, Any]:
        return {"done": True, **dataclasses.asdict(self)}


def error_event(message: str) -> Event:
    return {"error": message}
