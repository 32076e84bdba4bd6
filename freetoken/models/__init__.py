"""The architecture registry: HF `model_type` -> model file, plus torch-free metadata.

Importing this package does not import torch; a model module is imported only by
`load_class`, so the server can describe a model (`/api/show`) without the engine. Every
model file satisfies the contract in `models/base.py`.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from freetoken.models import hub

__all__ = [
    "ARCHITECTURES",
    "Arch",
    "UnsupportedModel",
    "arch_for",
    "arch_for_gguf",
    "format_parameter_size",
    "load_class",
    "model_info",
    "parameter_count",
]


class UnsupportedModel(ValueError):
    """config.json names an architecture FreeToken has no model file for."""


@dataclass(frozen=True, slots=True)
class Arch:
    model_type: str
    module: str
    gguf_arch: str  # the architecture name GGUF and Ollama's model_info use
    family: str


ARCHITECTURES: dict[str, Arch] = {
    a.model_type: a
    for a in (
        Arch("qwen3_moe", "freetoken.models.qwen3_moe", "qwen3moe", "qwen3moe"),
        Arch("qwen2_moe", "freetoken.models.qwen2_moe", "qwen2moe", "qwen2moe"),
        # llama.cpp writes Mixtral as llama with expert tensors, and Ollama names it so
        Arch("mixtral", "freetoken.models.mixtral", "llama", "llama"),
        Arch("olmoe", "freetoken.models.olmoe", "olmoe", "olmoe"),
        Arch("minimax_m2", "freetoken.models.minimax_m2", "minimax-m2", "minimax-m2"),
        Arch("glm4_moe", "freetoken.models.glm4_moe", "glm4moe", "glm4moe"),
        # llama.cpp's deepseek2 files of either DeepSeek are read by the first; its
        # config_from_gguf names the one a file is
        Arch("deepseek_v3", "freetoken.models.deepseek_v3", "deepseek2", "deepseek2"),
        Arch("deepseek_v2", "freetoken.models.deepseek_v2", "deepseek2", "deepseek2"),
        Arch("glm4_moe_lite", "freetoken.models.glm4_moe_lite", "glm4moelite", "glm4moelite"),
        Arch("deepseek_v4", "freetoken.models.deepseek_v4", "deepseek4", "deepseek4"),
        # GLM-5: DeepSeek-V3's model with DeepSeek's sparse attention (llama.cpp's glm-dsa)
        Arch("glm_moe_dsa", "freetoken.models.glm_moe_dsa", "glm-dsa", "glm-dsa"),
        # llama.cpp's GGUF architecture is gpt-oss; Ollama names the family gptoss
        Arch("gpt_oss", "freetoken.models.gpt_oss", "gpt-oss", "gptoss"),
        Arch("qwen3_next", "freetoken.models.qwen3_next", "qwen3next", "qwen3next"),
        # the multimodal checkpoint (text_config inside) and its language model alone
        Arch("qwen3_5_moe", "freetoken.models.qwen3_5_moe", "qwen35moe", "qwen35moe"),
        Arch("qwen3_5_moe_text", "freetoken.models.qwen3_5_moe", "qwen35moe", "qwen35moe"),
        Arch("ernie4_5_moe", "freetoken.models.ernie4_5_moe", "ernie4_5-moe", "ernie4_5-moe"),
        Arch("dots1", "freetoken.models.dots1", "dots1", "dots1"),
        Arch("granitemoe", "freetoken.models.granitemoe", "granitemoe", "granitemoe"),
        # the multimodal checkpoint's language model, on text
        Arch("qwen3_vl_moe", "freetoken.models.qwen3_vl_moe", "qwen3vlmoe", "qwen3vlmoe"),
    )
}


def _supported(names) -> str:
    return ", ".join(sorted(names))


def arch_for(config: Mapping[str, Any]) -> Arch:
    model_type = config.get("model_type")
    arch = ARCHITECTURES.get(str(model_type))
    if arch is None:
        raise UnsupportedModel(
            f"unsupported model_type {model_type!r} (supported: {_supported(ARCHITECTURES)})"
        )
    return arch


def arch_for_gguf(gguf_arch: str | None) -> Arch:
    """The architecture of a GGUF file's `general.architecture`."""
    found = [a for a in ARCHITECTURES.values() if a.gguf_arch == gguf_arch]
    if not found:
        known = _supported(a.gguf_arch for a in ARCHITECTURES.values())
        raise UnsupportedModel(f"unsupported GGUF architecture {gguf_arch!r} (supported: {known})")
    return found[0]


def load_class(config: Mapping[str, Any]) -> type:
    """The `Model` class of the architecture (imports torch)."""
    return importlib.import_module(arch_for(config).module).Model


def parameter_count(config: Mapping[str, Any]) -> int:
    """Parameters of a decoder-only MoE transformer, estimated from its config alone: the
    store counts a converted model's tensors instead (ftw.json), which is exact for any
    family."""
    config = hub.text_config(config)
    h = int(config["hidden_size"])
    v = int(config["vocab_size"])
    layers = int(config["num_hidden_layers"])
    nq = int(config["num_attention_heads"])
    nkv = int(hub.first(config, "num_key_value_heads", default=nq))
    hd = int(hub.first(config, "head_dim", default=h // nq))
    attn = h * hd * (2 * nq + 2 * nkv) + 2 * hd + 2 * h
    e = hub.num_experts(config)
    moe = e * 3 * h * int(hub.first(config, "moe_intermediate_size", default=0)) + e * h
    dense = 3 * h * int(hub.first(config, "intermediate_size", default=0))
    sparse = set(config.get("mlp_only_layers") or [])
    step = int(hub.first(config, "decoder_sparse_step", default=1)) or 1
    total = 0
    for i in range(layers):
        is_moe = e > 0 and i not in sparse and (i + 1) % step == 0
        total += attn + (moe if is_moe else dense)
    head = 0 if config.get("tie_word_embeddings") else v * h
    return total + v * h + head + h


def format_parameter_size(n: int) -> str:
    """Ollama's short form: 30.5B, 494.03M, 190.45K."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}".rstrip("0").rstrip(".") + unit
    return str(n)


def tensor_counts(tensors: list[Mapping[str, Any]], config: Mapping[str, Any]) -> tuple[int, int]:
    """(total, active) parameters from an FTW index's tensor entries: exact for any family.
    Active counts the dense tensors and the share of expert banks a token routes to."""

    def numel(t: Mapping[str, Any]) -> int:
        n = 1
        for d in t["shape"]:
            n *= int(d)
        return n

    total = sum(numel(t) for t in tensors)
    experts = sum(numel(t) for t in tensors if t.get("kind") == "bank")
    config = hub.text_config(config)
    e = hub.num_experts(config)
    k = hub.experts_per_token(config, default=e)
    active = total - experts + (experts * k // e if e else 0)
    return total, active


def model_info(config: Mapping[str, Any], index: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """GGUF-style metadata keys for `/api/show`. A converted model's index (ftw.json) holds
    the keys its model file gave (`Model.model_info`) and the tensors to count; a model
    converted before ftw.json carried them gets the keys every family shares, and a count
    estimated from config.json."""
    info = dict((index or {}).get("model_info") or {})
    if not info:
        info = hub.standard_info(arch_for(config).gguf_arch, config)
    tensors = (index or {}).get("tensors")
    if tensors:
        total, active = tensor_counts(tensors, config)
        info["general.active_parameter_count"] = active
    else:
        total = parameter_count(config)
    return {"general.parameter_count": total, **info}
