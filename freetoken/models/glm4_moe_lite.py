"""GLM-4.7-Flash (`glm4_moe_lite`): DeepSeek-V3's model (models/deepseek_v3.py), multi-head
latent attention and sigmoid grouped routing with a correction bias alike; the dense layers
are named by transformers 5's `mlp_layer_types` or the Hub's `first_k_dense_replace` (one
leading dense layer by default). Its GGUF files are llama.cpp's `deepseek2` (served by
DeepSeek-V3's model, the same computation) or Ollama's own `glm4moelite`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from freetoken.models import deepseek_gguf, deepseek_v3

MODEL_TYPE = "glm4_moe_lite"
GGUF_ARCH = "glm4moelite"


@dataclass(frozen=True)
class ModelArgs(deepseek_v3.ModelArgs):
    FIRST_DENSE: ClassVar[int] = 1

    @classmethod
    def dense_layers_of(cls, cfg: Mapping[str, Any]) -> tuple[int, ...]:
        kinds = cfg.get("mlp_layer_types")
        if kinds:
            return tuple(i for i, kind in enumerate(kinds) if kind == "dense")
        return super().dense_layers_of(cfg)


class Model(deepseek_v3.Model):
    Args = ModelArgs
    GGUF_ARCH = GGUF_ARCH
    GGUF_SIGMOID_TYPE = MODEL_TYPE
    GGUF_GATING = deepseek_gguf.GATING_SIGMOID
