"""dots.llm1 (dots1; rednote's dots.llm1, 142B-A14B): GQA with q/k RMSNorm per head and full
rotary, `attention_bias` on every attention projection, sliding-window layers where
`layer_types` says so, the first `first_k_dense_replace` layers dense, the rest routed by
sigmoid scores plus a correction bias (groups, then top-k, weights optionally renormalised
and scaled by routed_scaling_factor) beside always-on shared experts.

Shapes: T = tokens in the step, H = hidden, E = experts, k = experts per token.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from freetoken.layers.mlp import GatedMLP
from freetoken.layers.moe import Experts, SigmoidGroupedTopK, SparseMoeBlock
from freetoken.layers.rope import RotaryEmbedding
from freetoken.models import common, hub
from freetoken.models.base import GGUF_TENSORS, ExpertSpec
from freetoken.models.decoder import DecoderLayer, DecoderModel, DecoderStack, attention

GGUF_ARCH = "dots1"
SLIDING, FULL = "sliding_attention", "full_attention"


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
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = False
    attention_bias: bool = False
    sliding_window: int = 0
    layer_types: tuple[str, ...] = field(default_factory=tuple)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> ModelArgs:
        common.require_default_rope(cfg)
        n = cfg["num_hidden_layers"]
        types = cfg.get("layer_types")
        if (
            not types
        ):  # transformers' rule: sliding from max_window_layers on, where a window is set
            window_from = cfg.get("max_window_layers", n)
            windowed = cfg.get("sliding_window") is not None
            types = [SLIDING if windowed and i >= window_from else FULL for i in range(n)]
        return common.args_from(
            cls,
            cfg,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
            n_routed_experts=hub.num_experts(cfg),
            rope_theta=hub.rope_theta(cfg),
            sliding_window=cfg.get("sliding_window") or 0,
            layer_types=tuple(types),
        )

    def window(self, i: int) -> int:
        return self.sliding_window if self.layer_types[i] == SLIDING else 0


def _mlp(a: ModelArgs, i: int) -> nn.Module:
    if i < a.first_k_dense_replace:
        return GatedMLP(a.hidden_size, a.intermediate_size)
    router = SigmoidGroupedTopK(
        a.hidden_size,
        a.n_routed_experts,
        a.num_experts_per_tok,
        n_group=a.n_group,
        topk_group=a.topk_group,
        norm_topk_prob=a.norm_topk_prob,
        routed_scaling=a.routed_scaling_factor,
    )
    shared = a.moe_intermediate_size * a.n_shared_experts
    return SparseMoeBlock(
        router,
        Experts(i, a.n_routed_experts, ExpertSpec(a.hidden_size, a.moe_intermediate_size)),
        shared_experts=GatedMLP(a.hidden_size, shared) if shared else None,
    )


def _layer(a: ModelArgs, i: int) -> DecoderLayer:
    attn = attention(a, i, qk_norm="head", bias=a.attention_bias, window=a.window(i))
    return DecoderLayer(attn, _mlp(a, i), a.hidden_size, a.rms_norm_eps)


class Model(DecoderModel):
    Args = ModelArgs

    def __init__(self, args: ModelArgs):
        rotary = RotaryEmbedding(args.head_dim, args.rope_theta)
        super().__init__(args, DecoderStack.of(args, _layer, rotary))

    @classmethod
    def model_info(cls, config: Mapping[str, Any]) -> dict[str, Any]:
        a = ModelArgs.from_dict(config)
        return hub.standard_info(GGUF_ARCH, config) | common.sigmoid_routing_info(GGUF_ARCH, a)

    @staticmethod
    def config_from_gguf(kv: Mapping[str, Any], arch: str) -> dict[str, Any]:
        """A Hub-style config.json from GGUF metadata; attention biases from the file's
        tensor names."""
        return {
            **common.gguf_base_config(kv, arch),
            "architectures": ["Dots1ForCausalLM"],
            "model_type": "dots1",
            **common.gguf_sigmoid_routing(kv, arch, shared=0, leading=0, norm=False),
            "attention_bias": "blk.0.attn_q.bias" in set(kv.get(GGUF_TENSORS) or ()),
        }
