"""Chat formats: how each family's model writes thinking and tool calls (one module per
format; the contract is base.py).

A model's format is declared by its architecture: the table below maps each HF
`model_type` to its family's format (the runner reads it from the model's config.json; a
GGUF file's is derived from its architecture and metadata, which the GGUF name alone
cannot say: llama.cpp's `deepseek2` holds DeepSeek and GLM-4.7-Flash alike). Models no
entry claims (Qwen's families, OLMoE, architectures added later) get the format whose
markers their template shows, Qwen's when it shows none of the others'.

Forced calls (`tool_choice`) have grammars in every format: JSON arguments (Qwen's,
DeepSeek's, Mistral's, Granite's, Harmony's) or tagged parameters whose strings are bare text and
other values JSON (GLM's, MiniMax-M2's, Qwen3-Coder's, DeepSeek-V4's DSML).
"""

from __future__ import annotations

from functools import lru_cache

from freetoken.chat.formats.base import CallSection, ChatFormat, Event, ParseOptions, Parser
from freetoken.chat.formats.deepseek import DeepSeekFormat
from freetoken.chat.formats.dsml import DsmlFormat
from freetoken.chat.formats.glm import GlmFormat
from freetoken.chat.formats.granite import GraniteFormat
from freetoken.chat.formats.harmony import HarmonyFormat
from freetoken.chat.formats.minimax import MiniMaxFormat
from freetoken.chat.formats.mistral import MistralFormat
from freetoken.chat.formats.qwen import QwenFormat

__all__ = [
    "BY_ARCHITECTURE",
    "FORMATS",
    "MARKERS",
    "CallSection",
    "ChatFormat",
    "DeepSeekFormat",
    "DsmlFormat",
    "Event",
    "GlmFormat",
    "GraniteFormat",
    "HarmonyFormat",
    "MiniMaxFormat",
    "MistralFormat",
    "ParseOptions",
    "Parser",
    "QwenFormat",
    "format_for",
]

FORMATS: tuple[type[ChatFormat], ...] = (
    QwenFormat,
    DeepSeekFormat,
    DsmlFormat,
    GlmFormat,
    MiniMaxFormat,
    MistralFormat,
    HarmonyFormat,
    GraniteFormat,
)

# model_type -> the format the family's checkpoints are trained to write
BY_ARCHITECTURE: dict[str, type[ChatFormat]] = {
    "deepseek_v3": DeepSeekFormat,
    "deepseek_v2": DeepSeekFormat,
    "deepseek_v4": DsmlFormat,
    "glm4_moe": GlmFormat,
    "glm4_moe_lite": GlmFormat,
    "glm_moe_dsa": GlmFormat,
    "minimax_m2": MiniMaxFormat,
    "mixtral": MistralFormat,
    "gpt_oss": HarmonyFormat,
    "granitemoe": GraniteFormat,
}

# what identifies a format in a template, most specific first (Qwen's is the default)
_TEMPLATE_MARKS: tuple[tuple[type[ChatFormat], str], ...] = (
    (HarmonyFormat, "<|channel|>"),
    (DsmlFormat, "｜DSML｜"),
    (DeepSeekFormat, "<｜tool▁call▁begin｜>"),
    (MiniMaxFormat, "<minimax:tool_call>"),
    (GlmFormat, "<arg_key>"),
    (MistralFormat, "[TOOL_CALLS]"),
    (GraniteFormat, "<|tool_call|>"),
)

# every format's control tokens: the runner decodes them as text, whatever the request's
# format (a request's template may choose another than the model's)
MARKERS: tuple[str, ...] = tuple(dict.fromkeys(m for f in FORMATS for m in f.markers))


@lru_cache(maxsize=64)
def format_for(architecture: str | None, template: str | None) -> ChatFormat:
    """The format of a model of `architecture` (its model_type) rendered with `template`."""
    cls = BY_ARCHITECTURE.get(architecture or "")
    if cls is None:
        t = template or ""
        cls = next((f for f, mark in _TEMPLATE_MARKS if mark in t), QwenFormat)
    return cls.from_template(template)
