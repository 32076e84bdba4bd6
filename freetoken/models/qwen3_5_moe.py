"""Qwen3.5-MoE (Qwen3.5-35B-A3B, Qwen3.6-35B-A3B), its language model: Qwen3-Next's hybrid
of Gated DeltaNet and gated attention layers (models/qwen3_next.py), with the DeltaNet's
input projections split (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a), every layer MoE
and the top-k weights always renormalised.

Checkpoints are the multimodal model's: config.json nests the language model's settings
under `text_config`, its tensors sit under `model.language_model.`, and the vision tower
(`model.visual.`) and multi-token-prediction weights (`mtp.`) are ignored. The rotary
embedding is multimodal (separate positions for time, height and width); a text token's
three positions are equal, so it is the plain rotary embedding.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from freetoken.models import common
from freetoken.models import qwen3_next as next_
from freetoken.models.base import GGUF_TENSORS, ExpertKey
from freetoken.models.hub import text_config

GGUF_ARCH = "qwen35moe"

_IGNORED = re.compile(r"(?:mtp|model\.visual)\.")


@dataclass(frozen=True)
class ModelArgs(next_.ModelArgs):
    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> ModelArgs:
        return super().from_dict(text_config(cfg))


def _layer(a: ModelArgs, i: int) -> next_.HybridLayer:
    mixer = next_.mixer(a, i, "split")
    return next_.HybridLayer(mixer, next_.moe_block(a, i), a.hidden_size, a.rms_norm_eps)


_experts = common.ExpertNames()


class Model(next_.Model):
    Args = ModelArgs
    build_layer = staticmethod(_layer)
    dense_key = staticmethod(common.renamer((common.LANGUAGE_MODEL, "model."), *next_._SHARED))

    @staticmethod
    def expert_key(name: str) -> ExpertKey | None:
        return _experts(common.language_model(name))

    @classmethod
    def ignored(cls, name: str, config: Mapping[str, Any]) -> bool:
        if _IGNORED.match(name):
            return True
        return super().ignored(common.language_model(name), text_config(config))

    @classmethod
    def model_info(cls, config: Mapping[str, Any]) -> dict[str, Any]:
        return next_.hybrid_info(GGUF_ARCH, text_config(config), ModelArgs.from_dict(config))

    @staticmethod
    def config_from_gguf(kv: Mapping[str, Any], arch: str) -> dict[str, Any]:
        return gguf_config(kv, arch)

    @staticmethod
    def gguf_float(key: str, config: Mapping[str, Any]) -> bool:
        return bool(config.get(TILED)) and key.endswith(".linear_attn.out_proj.weight")

    @staticmethod
    def gguf_tensor(
        key: str, t: torch.Tensor, fmt: str | None, config: Mapping[str, Any]
    ) -> tuple[torch.Tensor, str | None]:
        if config.get(TILED):
            t, fmt = _untiled(key, t, fmt, next_.ModelArgs.from_dict(config))
        return next_.gguf_values(key, t), fmt


# A qwen35moe file holds Qwen3.5 (b and a as ssm_beta, ssm_alpha), or Qwen3-Next as Ollama
# converts it (b and a grouped in ssm_ba; its value heads as the Hub orders them).
# Converters of Qwen3.5 reorder the value heads where they outnumber the key heads: the
# value head serving key head g as its j-th goes from g·r + j to j·HK + g ("tiled"), so
# that GGML broadcasts the key heads; the import puts them back.
TILED = "gguf_value_heads_tiled"


def gguf_config(kv: Mapping[str, Any], arch: str) -> dict[str, Any]:
    config = next_.gguf_config(kv, arch)
    names = set(kv.get(GGUF_TENSORS) or ())
    if any(n.endswith(".ssm_ba.weight") for n in names):
        return config  # Qwen3-Next
    tiled = config["linear_num_value_heads"] != config["linear_num_key_heads"]
    return {
        **config,
        "architectures": ["Qwen3_5MoeForCausalLM"],
        "model_type": "qwen3_5_moe_text",
        "linear_projections": "split",
        "norm_topk_prob": True,
        TILED: bool(kv.get(f"{arch}.ssm.v_head_reordered", tiled)) and tiled,
    }


def _untiled(
    key: str, t: torch.Tensor, fmt: str | None, a: next_.ModelArgs
) -> tuple[torch.Tensor, str | None]:
    """The tensor with its value heads in the Hub's order (rows of a packed tensor move
    whole; the output projection's columns cannot: it comes decoded, `gguf_float`)."""
    _, found, part = key.partition(".linear_attn.")
    if not found:
        return t, fmt
    hk, dv = a.linear_num_key_heads, a.linear_value_head_dim
    r = a.linear_num_value_heads // hk
    qk = 2 * hk * a.linear_key_head_dim
    if part in ("in_proj_qkv.weight", "conv1d.weight"):
        return torch.cat([t[:qk], _grouped(t[qk:], 0, hk, r, dv)]), fmt
    if part == "in_proj_z.weight":
        return _grouped(t, 0, hk, r, dv), fmt
    if part in ("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias"):
        return _grouped(t, 0, hk, r, 1), fmt
    if part == "out_proj.weight":
        assert fmt is None, "gguf_float asks for this one decoded"
        return _grouped(t, 1, hk, r, dv), fmt
    return t, fmt


def _grouped(t: torch.Tensor, dim: int, hk: int, r: int, width: int) -> torch.Tensor:
    """Heads of `width` along `dim` from tiled order ([r, HK]) to grouped ([HK, r])."""
    shape = t.shape
    tiled = t.reshape(*shape[:dim], r, hk, width, *shape[dim + 1 :])
    return tiled.transpose(dim, dim + 1).reshape(shape)
