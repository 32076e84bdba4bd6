"""ERNIE-4.5 MoE (ERNIE-4.5-21B-A3B, ERNIE-4.5-300B-A47B): GQA with rotary on adjacent
dimension pairs over the whole head, the same bias setting (`use_bias`) on every projection,
dense SwiGLU layers outside the MoE range, and MoE layers (every `moe_layer_interval`-th from
`moe_layer_start_index` to `moe_layer_end_index`) routed by softmax probabilities plus a
correction bias (the chosen probabilities renormalised, the sum held at `moe_norm_min` or
more) beside always-on shared experts.

Checkpoints may carry a multi-token-prediction block (`model.mtp_*`) after the layers; the
model does not run it and the weight readers skip it.

Shapes: T = tokens in the step, H = hidden, E = experts, k = experts per token.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from freetoken.layers.mlp import GatedMLP
from freetoken.layers.moe import Experts, SparseMoeBlock
from freetoken.layers.rope import RotaryEmbedding
from freetoken.layers.routers import SoftmaxBiasedTopK
from freetoken.models import common, hub
from freetoken.models.base import GGUF_TENSORS, ExpertSpec
from freetoken.models.decoder import DecoderLayer, DecoderModel, DecoderStack, attention

GGUF_ARCH = "ernie4_5-moe"
_MTP = re.compile(r"model\.mtp_")


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int  # the dense layers'
    moe_intermediate_size: int
    moe_num_experts: int
    moe_k: int
    moe_num_shared_experts: int = 0
    moe_layer_start_index: int = 1
    moe_layer_end_index: int = -1  # -1: the last layer
    moe_layer_interval: int = 1
    moe_norm_min: float = 1e-12
    use_bias: bool = False
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    tie_word_embeddings: bool = True  # transformers' default for the family
    max_position_embeddings: int = 131072

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> ModelArgs:
        common.require_default_rope(cfg)
        return common.args_from(
            cls,
            cfg,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
            moe_num_experts=hub.num_experts(cfg),
            moe_k=hub.experts_per_token(cfg),
            rope_theta=hub.rope_theta(cfg, default=500000.0),
        )

    def is_moe_layer(self, i: int) -> bool:
        last = (
            self.num_hidden_layers - 1 if self.moe_layer_end_index < 0 else self.moe_layer_end_index
        )
        return (
            self.moe_num_experts > 0
            and (i + 1) % self.moe_layer_interval == 0
            and self.moe_layer_start_index <= i <= last
        )


def _mlp(a: ModelArgs, i: int) -> nn.Module:
    if not a.is_moe_layer(i):
        return GatedMLP(a.hidden_size, a.intermediate_size, bias=a.use_bias)
    router = SoftmaxBiasedTopK(a.hidden_size, a.moe_num_experts, a.moe_k, a.moe_norm_min)
    spec = ExpertSpec(a.hidden_size, a.moe_intermediate_size)
    shared = a.moe_intermediate_size * a.moe_num_shared_experts
    return SparseMoeBlock(
        router,
        Experts(i, a.moe_num_experts, spec),
        shared_experts=GatedMLP(a.hidden_size, shared, bias=a.use_bias) if shared else None,
    )


def _layer(a: ModelArgs, i: int) -> DecoderLayer:
    attn = attention(a, i, bias=a.use_bias, rope_pairs=True)
    return DecoderLayer(attn, _mlp(a, i), a.hidden_size, a.rms_norm_eps)


class Model(DecoderModel):
    Args = ModelArgs

    def __init__(self, args: ModelArgs):
        rotary = RotaryEmbedding(args.head_dim, args.rope_theta, pairs=True)
        super().__init__(args, DecoderStack.of(args, _layer, rotary), head_bias=args.use_bias)

    @classmethod
    def ignored(cls, name: str, config: Mapping[str, Any]) -> bool:
        return _MTP.match(name) is not None or super().ignored(name, config)

    # the correction bias sits beside the router (Hub) or inside it (transformers 5)
    dense_key = staticmethod(common.renamer((r"\.mlp\.(?:gate\.)?moe_statics\.", ".mlp.gate.")))

    @classmethod
    def model_info(cls, config: Mapping[str, Any]) -> dict[str, Any]:
        a = ModelArgs.from_dict(config)
        info = hub.standard_info(GGUF_ARCH, config)
        first_moe = next((i for i in range(a.num_hidden_layers) if a.is_moe_layer(i)), 0)
        info |= {
            f"{GGUF_ARCH}.expert_shared_count": a.moe_num_shared_experts,
            f"{GGUF_ARCH}.leading_dense_block_count": first_moe,
            f"{GGUF_ARCH}.interleave_moe_layer_step": a.moe_layer_interval,
        }
        return info

    @staticmethod
    def config_from_gguf(kv: Mapping[str, Any], arch: str) -> dict[str, Any]:
        """A Hub-style config.json from GGUF metadata (llama.cpp's converter writes the MoE
        range as a leading dense count and an interleave step); whether the projections have
        biases from the file's tensor names."""

        def g(key: str, default: Any = None) -> Any:
            return kv.get(f"{arch}.{key}", default)

        names = set(kv.get(GGUF_TENSORS) or ())
        return {
            **common.gguf_base_config(kv, arch),
            "architectures": ["Ernie4_5_MoeForCausalLM"],
            "model_type": "ernie4_5_moe",
            "moe_num_experts": int(g("expert_count")),
            "moe_intermediate_size": int(g("expert_feed_forward_length")),
            "moe_num_shared_experts": int(g("expert_shared_count", 0)),
            "moe_layer_start_index": int(g("leading_dense_block_count", 0)),
            "moe_layer_interval": int(g("interleave_moe_layer_step", 1)),
            "use_bias": "blk.0.attn_q.bias" in names,
        }
