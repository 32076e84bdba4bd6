"""Ollama's request `options`: names, types and defaults, shared by the Modelfile parser,
the API layer (validation and merging) and the runner (sampling).

Precedence is request options > Modelfile PARAMETERs > these defaults. Unknown keys are
ignored (Ollama logs and ignores them); a known key with the wrong type is an error.

FreeToken's own options: `moe_policy` and `vram_budget` (how experts are placed),
`cache_prompt` (false: the request reuses nothing from the prefix cache), `ignore_eos`
(true: the answer runs to num_predict tokens past end-of-text, as benchmarks need), and
`tool_choice` ("auto", "none" or "required") for clients that cannot send the request field
of that name. "none" keeps the tools out of the prompt. "required" forces the answer to be
one tool call, but only while the conversation's last message is not a tool result: an
agent loop (OpenCode, OpenClaw) gets a forced call first and a free answer once the tool
has answered. A request's own `tool_choice` field overrides the option, except an explicit
"auto", which SDKs send by default (freetoken/chat/structured.py has the details).
"""

from __future__ import annotations

from typing import Any

__all__ = ["DEFAULTS", "OPTION_TYPES", "IGNORED", "OptionError", "coerce", "merge", "validate"]


class OptionError(ValueError):
    """An option has a value of the wrong type."""


# name -> type ("int", "float", "bool", "str", "list[str]")
OPTION_TYPES: dict[str, str] = {
    # sampling
    "num_keep": "int",
    "seed": "int",
    "num_predict": "int",
    "top_k": "int",
    "top_p": "float",
    "min_p": "float",
    "typical_p": "float",
    "repeat_last_n": "int",
    "temperature": "float",
    "repeat_penalty": "float",
    "presence_penalty": "float",
    "frequency_penalty": "float",
    "stop": "list[str]",
    # runner
    "num_ctx": "int",
    "num_batch": "int",
    "num_gpu": "int",
    "main_gpu": "int",
    "use_mmap": "bool",
    "num_thread": "int",
    "draft_num_predict": "int",
    # FreeToken's own
    "moe_policy": "str",
    "vram_budget": "str",
    "tool_choice": "str",  # "auto" | "none" | "required": see above
    "cache_prompt": "bool",  # false: compute the whole prompt, reusing no cached prefix
    "ignore_eos": "bool",  # true: generate num_predict tokens, past end-of-text (benchmarks)
}

# Legacy keys ollama-python still sends: accepted, type-checked loosely, ignored.
IGNORED: frozenset[str] = frozenset(
    {
        "numa",
        "low_vram",
        "vocab_only",
        "use_mlock",
        "mirostat",
        "mirostat_tau",
        "mirostat_eta",
        "tfs_z",
        "penalize_newline",
        "embedding_only",
        "logits_all",
        "f16_kv",
    }
)

DEFAULTS: dict[str, Any] = {
    "num_keep": 4,
    "seed": -1,
    "num_predict": -1,
    "top_k": 40,
    "top_p": 0.9,
    "min_p": 0.0,
    "typical_p": 1.0,
    "repeat_last_n": 64,
    "temperature": 0.8,
    "repeat_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "stop": [],
}

# Options whose change needs the model loaded differently (Ollama reloads for these).
LOAD_OPTIONS: frozenset[str] = frozenset(
    {"num_ctx", "moe_policy", "vram_budget", "num_gpu", "main_gpu"}
)


def _type_error(name: str, kind: str, value: Any) -> OptionError:
    return OptionError(
        f'option "{name}" must be of type {kind}, got {type(value).__name__} {value!r}'
    )


def coerce(name: str, value: Any, *, from_text: bool = False) -> Any:
    """Check (or, for Modelfile text, convert) one option value."""
    kind = OPTION_TYPES.get(name)
    if kind is None:
        return value
    if from_text and isinstance(value, str):
        return _from_text(name, kind, value)
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
            raise _type_error(name, "integer", value)
        return int(value)
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _type_error(name, "number", value)
        return float(value)
    if kind == "bool":
        if not isinstance(value, bool):
            raise _type_error(name, "boolean", value)
        return value
    if kind == "list[str]":
        if isinstance(value, str):
            return [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise _type_error(name, "array of strings", value)
        return list(value)
    if not isinstance(value, str):
        raise _type_error(name, "string", value)
    return value


def _from_text(name: str, kind: str, text: str) -> Any:
    try:
        if kind == "int":
            return int(text)
        if kind == "float":
            return float(text)
        if kind == "bool":
            low = text.lower()
            if low not in ("true", "false", "1", "0"):
                raise ValueError
            return low in ("true", "1")
    except ValueError:
        raise OptionError(f"invalid value for parameter {name!r}: {text!r}") from None
    if kind == "list[str]":
        return [text]
    return text


def validate(options: Any) -> dict[str, Any]:
    """A checked copy of a request's `options` object; unknown keys are dropped."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise OptionError("options must be an object")
    out: dict[str, Any] = {}
    for name, value in options.items():
        if name in IGNORED or name not in OPTION_TYPES:
            continue
        if value is None:
            continue
        out[name] = coerce(name, value)
    return out


def merge(*layers: dict[str, Any] | None) -> dict[str, Any]:
    """Defaults, then each layer in order (later wins)."""
    out = dict(DEFAULTS)
    for layer in layers:
        if layer:
            out.update(layer)
    return out
