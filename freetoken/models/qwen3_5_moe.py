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

from freetoken.models import UnsupportedModel, common
from freetoken.models import qwen3_next as next_
from freetoken.models.base import ExpertKey
from freetoken.models.hub import text_config

GGUF_ARCH = "qwen35moe"

_PREFIX = re.compile(r"^model\.language_model\.")
_IGNORED = re.compile(r"(?:mtp|model\.visual)\.")


@dataclass(frozen=True)
class ModelArgs(next_.ModelArgs):
    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> ModelArgs:
        return super().from_dict(text_config(cfg))


def _layer(a: ModelArgs, i: int) -> next_.HybridLayer:
    mixer = next_.mixer(a, i, "split")
    return next_.HybridLayer(mixer, next_.moe_block(a, i), a.hidden_size, a.rms_norm_eps)


def _language_model(name: str) -> str:
    return _PREFIX.sub("model.", name)


_experts = common.ExpertNames()


class Model(next_.Model):
    args_class = ModelArgs
    build_layer = staticmethod(_layer)
    dense_key = staticmethod(common.renamer((_PREFIX.pattern, "model."), *next_._SHARED))

    @staticmethod
    def expert_key(name: str) -> ExpertKey | None:
        return _experts(_language_model(name))

    @classmethod
    def ignored(cls, name: str, config: Mapping[str, Any]) -> bool:
        if _IGNORED.match(name):
            return True
        return super().ignored(_language_model(name), text_config(config))

    @classmethod
    def model_info(cls, config: Mapping[str, Any]) -> dict[str, Any]:
        return next_.hybrid_info(GGUF_ARCH, text_config(config), ModelArgs.from_dict(config))

    # llama.cpp's qwen35moe files reorder the value heads (key heads tiled, not grouped),
    # which no layout here reads yet
    @staticmethod
    def gguf_key(name: str) -> str | ExpertKey:
        raise UnsupportedModel(GGUF_UNSUPPORTED)

    @staticmethod
    def config_from_gguf(kv: Mapping[str, Any], arch: str) -> dict[str, Any]:
        raise UnsupportedModel(GGUF_UNSUPPORTED)


GGUF_UNSUPPORTED = (
    "GGUF files of Qwen3.5-MoE are not read yet: create the model from its Hugging Face "
    "(safetensors) directory"
)
