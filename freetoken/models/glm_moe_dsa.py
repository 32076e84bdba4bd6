"""GLM-5 (`glm_moe_dsa`): DeepSeek-V3's model (models/deepseek_v3.py) — multi-head latent
attention with DeepSeek's interleaved rope, leading dense layers, sigmoid grouped routing
with a correction bias beside a shared expert — with DeepSeek's sparse attention: each
layer's lightning indexer (its own projections, a LayerNorm'd key per token, rope on its
first dimensions) chooses the `index_topk` cached tokens each query attends to. Layers
whose `indexer_types` entry is "shared" have no indexer and reuse the choice of the last
layer that has one.

Shapes: T = tokens in the step, K = positions a token attends to.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from torch import nn

from freetoken.layers.indexer import TokenIndexer
from freetoken.layers.sparse_mla import SparseMLAttention
from freetoken.models import deepseek_v3, glm4_moe_lite, hub
from freetoken.models.base import KVLayout

MODEL_TYPE = "glm_moe_dsa"
GGUF_ARCH = "glm-dsa"  # llama.cpp's name for the architecture


@dataclass(frozen=True)
class ModelArgs(glm4_moe_lite.ModelArgs):
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 32
    indexer_types: tuple[str, ...] = ()  # per layer: "full" (its own indexer) or "shared"

    FIRST_DENSE: ClassVar[int] = 3

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> ModelArgs:
        a = super().from_dict(cfg)
        return replace(a, indexer_types=indexer_types(cfg, a.num_hidden_layers))


def indexer_types(cfg: Mapping[str, Any], layers: int) -> tuple[str, ...]:
    """Which layers run an indexer: `indexer_types` as transformers writes it, else a
    pattern ("FSS…"), else every `index_topk_freq`-th layer from `index_skip_topk_offset`
    on (every layer by default)."""
    kinds = cfg.get("indexer_types")
    if kinds:
        return tuple(kinds)
    pattern = cfg.get("index_topk_pattern")
    if pattern is not None:
        return tuple({"F": "full", "S": "shared"}[c] for c in pattern)
    freq = max(int(hub.first(cfg, "index_topk_freq", default=1)), 1)
    offset = int(hub.first(cfg, "index_skip_topk_offset", default=2))
    return tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers))


class DecoderLayer(deepseek_v3.DecoderLayer):
    @staticmethod
    def attention(a: ModelArgs, i: int) -> nn.Module:
        indexer = None
        if a.indexer_types[i] == "full":
            indexer = TokenIndexer(
                i,
                a.hidden_size,
                a.q_lora_rank,
                a.index_n_heads,
                a.index_head_dim,
                a.qk_rope_head_dim,
                a.index_topk,
            )
        kw = deepseek_v3.attention_args(a)
        return SparseMLAttention(i, a.hidden_size, a.num_attention_heads, indexer, **kw)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        chosen: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, chosen = self.self_attn(self.input_layernorm(x), rope, chosen)
        x = x + out
        return x + self.mlp(self.post_attention_layernorm(x)), chosen


class GlmDsaModel(deepseek_v3.DeepseekModel):
    def __init__(self, a: ModelArgs, make_router=deepseek_v3.router_of):
        super().__init__(a, make_router, DecoderLayer)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, H]
        rope = self.rotary(positions, x.dtype)
        chosen = None  # [T, K] positions the last indexer chose
        for layer in self.layers:
            x, chosen = layer(x, rope, chosen)
        return self.norm(x)


class Model(deepseek_v3.Model):
    Args = ModelArgs
    Stack = GlmDsaModel
    GGUF_ARCH = GGUF_ARCH
    FP32 = ("e_score_correction_bias", "gate.weight")  # as transformers keeps them

    def __init__(self, args: ModelArgs):
        if not args.q_lora_rank:
            raise ValueError("the sparse attention's indexer needs a low-rank q (q_lora_rank)")
        if args.indexer_types[:1] != ("full",):
            raise ValueError("the first layer must run an indexer (indexer_types[0] 'full')")
        super().__init__(args)

    def layer_kv(self, i: int) -> KVLayout:
        a = self.args
        return KVLayout.latent(a.kv_lora_rank + a.qk_rope_head_dim, index_dim=a.index_head_dim)

    @classmethod
    def model_info(cls, config: Mapping[str, Any]) -> dict[str, Any]:
        a = cls.Args.from_dict(config)
        info = super().model_info(config)
        return info | {
            f"{GGUF_ARCH}.attention.indexer.head_count": a.index_n_heads,
            f"{GGUF_ARCH}.attention.indexer.key_length": a.index_head_dim,
            f"{GGUF_ARCH}.attention.indexer.top_k": a.index_topk,
        }

    @classmethod
    def config_from_gguf(cls, kv: Mapping[str, Any], arch: str) -> dict[str, Any]:
        raise ValueError(f"GGUF files of {arch} are not read yet: convert from safetensors")
