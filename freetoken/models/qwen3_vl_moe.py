"""Qwen3-VL-MoE (Qwen3-VL-30B-A3B, Qwen3-VL-235B-A22B), its language model on text:
Qwen3-MoE (models/qwen3_moe.py) with the top-k weights always renormalised. Its rotary
embedding is multimodal (time, height and width positions interleaved over the rotated
pairs); a text token's three positions are equal, so it is the plain rotary embedding.
DeepStack adds vision features to the first layers' hidden states, which text never does.

Checkpoints are the multimodal model's: config.json nests the language model's settings
under `text_config`, its tensors sit under `model.language_model.`, the vision tower
(`model.visual.`) is ignored, and the experts are whole banks stored transposed
(gate_up_proj [E, H, 2I], down_proj [E, I, H]). llama.cpp's `qwen3vlmoe` GGUF holds the
language model with Qwen3-MoE's tensor names (its vision tower is a file of its own);
Ollama's holds the vision tower too, which is left out.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from freetoken.models import common, qwen3_moe
from freetoken.models.base import ExpertKey
from freetoken.models.hub import standard_info, text_config

GGUF_ARCH = "qwen3vlmoe"

# the vision tower: the Hub's model.visual., and the v.* (and mm.*) tensors Ollama's GGUF
# files hold beside the language model's
_IGNORED = re.compile(r"model\.visual\.|v\.|mm\.")
_BANK = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")


@dataclass(frozen=True)
class ModelArgs(qwen3_moe.ModelArgs):
    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> ModelArgs:
        # the router renormalises its top-k weights whatever the config says
        return super().from_dict({**text_config(cfg), "norm_topk_prob": True})


class Model(qwen3_moe.Model):
    Args = ModelArgs

    @staticmethod
    def dense_key(name: str) -> str:
        return common.language_model(name)

    @staticmethod
    def expert_key(name: str) -> ExpertKey | None:
        m = _BANK.fullmatch(common.language_model(name))
        if m is None:
            return None
        bank = "gate_up" if m.group(2) == "gate_up_proj" else "down"
        return ExpertKey(int(m.group(1)), bank, transposed=True)

    @classmethod
    def ignored(cls, name: str, config: Mapping[str, Any]) -> bool:
        if _IGNORED.match(name):
            return True
        return super().ignored(common.language_model(name), text_config(config))

    @classmethod
    def model_info(cls, config: Mapping[str, Any]) -> dict[str, Any]:
        return standard_info(GGUF_ARCH, text_config(config))

    @staticmethod
    def config_from_gguf(kv: Mapping[str, Any], arch: str) -> dict[str, Any]:
        config = qwen3_moe.Model.config_from_gguf(kv, arch)
        return {**config, "architectures": ["Qwen3VLMoeForConditionalGeneration"]} | {
            "model_type": "qwen3_vl_moe"
        }
