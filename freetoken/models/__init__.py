"""The architecture registry: HF `model_type` -> model file, plus torch-free metadata.

Importing this package does not import torch; a model module is imported only by
`load_class`, so the server can describe a model (`/api/show`) without the engine.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

__all__ = ["ARCHITECTURES", "Arch", "UnsupportedModel", "arch_for", "load_class", "model_info"]


class UnsupportedModel(ValueError):
    """config.json names an architecture FreeToken has no model file for."""


@dataclass(frozen=True, slots=True)
class Arch:
    model_type: str
    module: str
    gguf_arch: str  # the architecture name GGUF and Ollama's model_info use
    family: str


ARCHITECTURES: dict[str, Arch] = {
    "qwen3_moe": Arch("qwen3_moe", "freetoken.models.qwen3_moe", "qwen3moe", "qwen3moe"),
}


def arch_for(config: dict[str, Any]) -> Arch:
    model_type = config.get("model_type")
    arch = ARCHITECTURES.get(str(model_type))
    if arch is None:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise UnsupportedModel(f"unsupported model_type {model_type!r} (supported: {supported})")
    return arch


def load_class(config: dict[str, Any]) -> type:
    """The `Model` class of the architecture (imports torch)."""
    return importlib.import_module(arch_for(config).module).Model


def _first(config: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for k in keys:
        if config.get(k) is not None:
            return config[k]
    return default


def rope_theta(config: dict[str, Any]) -> float:
    """`rope_theta` from either spelling: top-level (Hub) or `rope_parameters` (transformers 5)."""
    params = config.get("rope_parameters") or {}
    return float(_first(config, "rope_theta", default=params.get("rope_theta", 10000.0)))


def num_experts(config: dict[str, Any]) -> int:
    return int(_first(config, "num_experts", "num_local_experts", "n_routed_experts", default=0))


def parameter_count(config: dict[str, Any]) -> int:
    """Parameters of a decoder-only MoE transformer, from its config alone."""
    h = int(config["hidden_size"])
    v = int(config["vocab_size"])
    layers = int(config["num_hidden_layers"])
    nq = int(config["num_attention_heads"])
    nkv = int(_first(config, "num_key_value_heads", default=nq))
    hd = int(_first(config, "head_dim", default=h // nq))
    attn = h * hd * (2 * nq + 2 * nkv) + 2 * hd + 2 * h
    e = num_experts(config)
    moe = e * 3 * h * int(_first(config, "moe_intermediate_size", default=0)) + e * h
    dense = 3 * h * int(_first(config, "intermediate_size", default=0))
    sparse = set(config.get("mlp_only_layers") or [])
    step = int(_first(config, "decoder_sparse_step", default=1)) or 1
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


def model_info(config: dict[str, Any]) -> dict[str, Any]:
    """GGUF-style metadata keys for `/api/show` (`qwen3moe.context_length`, …)."""
    arch = arch_for(config)
    a = arch.gguf_arch
    nq = int(config["num_attention_heads"])
    info: dict[str, Any] = {
        "general.architecture": a,
        "general.parameter_count": parameter_count(config),
        f"{a}.context_length": int(_first(config, "max_position_embeddings", default=4096)),
        f"{a}.embedding_length": int(config["hidden_size"]),
        f"{a}.block_count": int(config["num_hidden_layers"]),
        f"{a}.feed_forward_length": int(_first(config, "intermediate_size", default=0)),
        f"{a}.attention.head_count": nq,
        f"{a}.attention.head_count_kv": int(_first(config, "num_key_value_heads", default=nq)),
        f"{a}.attention.key_length": int(
            _first(config, "head_dim", default=config["hidden_size"] // nq)
        ),
        f"{a}.attention.layer_norm_rms_epsilon": float(
            _first(config, "rms_norm_eps", default=1e-6)
        ),
        f"{a}.rope.freq_base": rope_theta(config),
        f"{a}.vocab_size": int(config["vocab_size"]),
    }
    e = num_experts(config)
    if e:
        info[f"{a}.expert_count"] = e
        info[f"{a}.expert_used_count"] = int(_first(config, "num_experts_per_tok", default=0))
        info[f"{a}.expert_feed_forward_length"] = int(
            _first(config, "moe_intermediate_size", default=0)
        )
    return info
