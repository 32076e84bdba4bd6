"""Reading Hub-style config.json files: the spellings families share, and the GGUF-style
metadata `show` prints. Torch-free, for the server and the model files alike."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "QUANT_FILE",
    "first",
    "num_experts",
    "read_config",
    "rope_parameters",
    "rope_theta",
    "standard_info",
    "text_config",
    "with_quant_file",
]


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's settings: a multimodal checkpoint's config.json nests them
    under `text_config` (the model's own keys win over the wrapper's); others as they are."""
    nested = config.get("text_config")
    return {**config, **nested} if isinstance(nested, Mapping) else config


def first(config: Mapping[str, Any], *keys: str, default: Any = None) -> Any:
    """The first of `keys` that config sets (not None)."""
    for k in keys:
        if config.get(k) is not None:
            return config[k]
    return default


def rope_theta(config: Mapping[str, Any], default: float = 10000.0) -> float:
    """`rope_theta` from either spelling: top-level (Hub) or `rope_parameters` (transformers 5)."""
    params = config.get("rope_parameters") or {}
    return float(first(config, "rope_theta", default=params.get("rope_theta", default)))


def rope_parameters(config: Mapping[str, Any]) -> dict[str, Any]:
    """The rope settings as one dict, from either spelling: `rope_scaling` beside a top-level
    `rope_theta` (Hub) or `rope_parameters` (transformers 5); the kind under `rope_type` (or
    the older `type`), `rope_theta` always set. A top-level `original_max_position_embeddings`
    wins over the dict's, as transformers has it."""
    params = dict(config.get("rope_scaling") or config.get("rope_parameters") or {})
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    params["rope_theta"] = rope_theta(config)
    if config.get("original_max_position_embeddings"):
        params["original_max_position_embeddings"] = config["original_max_position_embeddings"]
    return params


def num_experts(config: Mapping[str, Any]) -> int:
    config = text_config(config)
    keys = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
    return int(first(config, *keys, default=0))


def experts_per_token(config: Mapping[str, Any], default: int = 0) -> int:
    """The routed experts a token takes (ERNIE-4.5 spells it `moe_k`)."""
    return int(first(text_config(config), "num_experts_per_tok", "moe_k", default=default) or 0)


def standard_info(gguf_arch: str, config: Mapping[str, Any]) -> dict[str, Any]:
    """The GGUF-style keys every decoder has (`<arch>.context_length`, ...), from the
    spellings most families use; a model file adds or replaces its own."""
    a, config = gguf_arch, text_config(config)
    nq = int(config["num_attention_heads"])
    info: dict[str, Any] = {
        "general.architecture": a,
        f"{a}.context_length": int(first(config, "max_position_embeddings", default=4096)),
        f"{a}.embedding_length": int(config["hidden_size"]),
        f"{a}.block_count": int(config["num_hidden_layers"]),
        f"{a}.feed_forward_length": int(first(config, "intermediate_size", default=0)),
        f"{a}.attention.head_count": nq,
        f"{a}.attention.head_count_kv": int(first(config, "num_key_value_heads", default=nq)),
        f"{a}.attention.key_length": int(
            first(config, "head_dim", default=config["hidden_size"] // nq)
        ),
        f"{a}.attention.layer_norm_rms_epsilon": float(first(config, "rms_norm_eps", default=1e-6)),
        f"{a}.rope.freq_base": rope_theta(config),
        f"{a}.vocab_size": int(config["vocab_size"]),
    }
    e = num_experts(config)
    if e:
        info[f"{a}.expert_count"] = e
        info[f"{a}.expert_used_count"] = experts_per_token(config)
        info[f"{a}.expert_feed_forward_length"] = int(
            first(config, "moe_intermediate_size", default=0)
        )
    return info


# NVIDIA's ModelOpt exports may declare their quantization only in this file (its
# "quantization" section: quant_algo, group_size, exclude_modules), leaving config.json
# without a `quantization_config`. `read_config` folds it in as the quantization_config newer
# exports write, so one reading decides what a checkpoint is: the converter, create's file
# type, doctor's estimate and the loader agree.
QUANT_FILE = "hf_quant_config.json"


def with_quant_file(config: dict[str, Any], quant_file: Any) -> dict[str, Any]:
    """`config` with `quant_file`'s quantization as its quantization_config, where config.json
    names none (config.json's own, where present, is the checkpoint's word)."""
    if config.get("quantization_config") or not isinstance(quant_file, dict):
        return config
    q = quant_file.get("quantization", quant_file)  # some exports put the fields at the top
    if not isinstance(q, dict) or not q.get("quant_algo"):
        return config
    return {**config, "quantization_config": {"quant_method": "modelopt", **q}}


def read_config(files: Mapping[str, Path]) -> dict[str, Any]:
    """config.json of a model's files (name -> path), with hf_quant_config.json folded in."""
    config = json.loads(Path(files["config.json"]).read_text())
    if QUANT_FILE in files:
        config = with_quant_file(config, json.loads(Path(files[QUANT_FILE]).read_text()))
    return config
