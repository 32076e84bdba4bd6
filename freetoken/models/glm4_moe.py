"""GLM-4.5 / GLM-4.5-Air (glm4_moe): GQA with q/k/v biases (no output bias), q/k RMSNorm
per head where use_qk_norm, partial rotary (partial_rotary_factor, 0.5 by default), the
first first_k_dense_replace layers dense, the rest routed by sigmoid scores plus a
correction bias (groups, then top-k, weights renormalised and scaled by
routed_scaling_factor) beside always-on shared experts.

Checkpoints append num_nextn_predict_layers multi-token-prediction layers after the last
one (GGUF counts them in block_count); the model does not run them and the weight readers
skip them (DecoderModel.ignored).

Shapes: T = tokens in the step, H = hidden, E = experts, k = experts per token.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from freetoken.layers.mlp import GatedMLP
from freetoken.layers.moe import Experts, SigmoidGroupedTopK, SparseMoeBlock
from freetoken.layers.rope import RotaryEmbedding
from freetoken.models import common, hub
from freetoken.models.base import GGUF_TENSORS, ExpertSpec
from freetoken.models.decoder import DecoderLayer, DecoderModel, DecoderStack, attention

GGUF_ARCH = "glm4moe"


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int
    intermediate_size: int  # the dense layers'
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int = 1
    first_k_dense_replace: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    attention_bias: bool = False
    use_qk_norm: bool = False
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 131072

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> ModelArgs:
        common.require_default_rope(cfg)
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        return common.args_from(
            cls,
            cfg,
            head_dim=head_dim,
            rotary_dim=common.rotary_dim(cfg, head_dim, default_factor=0.5),
            n_routed_experts=hub.num_experts(cfg),
            rope_theta=hub.rope_theta(cfg),
        )


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
    spec = ExpertSpec(a.hidden_size, a.moe_intermediate_size)
    shared = a.moe_intermediate_size * a.n_shared_experts
    return SparseMoeBlock(
        router,
        Experts(i, a.n_routed_experts, spec),
        shared_experts=GatedMLP(a.hidden_size, shared) if shared else None,
    )


def _layer(a: ModelArgs, i: int) -> DecoderLayer:
    attn = attention(
        a, i, qk_norm="head" if a.use_qk_norm else None, bias=a.attention_bias, o_bias=False
    )
    return DecoderLayer(attn, _mlp(a, i), a.hidden_size, a.rms_norm_eps)


class Model(DecoderModel):
    Args = ModelArgs

    def __init__(self, args: ModelArgs):
        rotary = RotaryEmbedding(args.rotary_dim, args.rope_theta)
        super().__init__(args, DecoderStack.of(args, _layer, rotary))

    @classmethod
    def model_info(cls, config: Mapping[str, Any]) -> dict[str, Any]:
        a = ModelArgs.from_dict(config)
        info = hub.standard_info(GGUF_ARCH, config)
        info[f"{GGUF_ARCH}.rope.dimension_count"] = a.rotary_dim
        return info | common.sigmoid_routing_info(GGUF_ARCH, a)

    @staticmethod
    def config_from_gguf(kv: Mapping[str, Any], arch: str) -> dict[str, Any]:
        """A Hub-style config.json from GGUF metadata; whether the attention has biases and
        q/k norms (GLM-4.5 has both, Air no norms) from the file's tensor names."""

        def g(key: str, default: Any = None) -> Any:
            return kv.get(f"{arch}.{key}", default)

        base = common.gguf_base_config(kv, arch)
        names = set(kv.get(GGUF_TENSORS) or ())
        nextn = int(g("nextn_predict_layers", 0))
        rot = int(g("rope.dimension_count", base["head_dim"] // 2))
        return {
            **base,
            "architectures": ["Glm4MoeForCausalLM"],
            "model_type": "glm4_moe",
            "num_hidden_layers": base["num_hidden_layers"] - nextn,
            "num_nextn_predict_layers": nextn,
            "partial_rotary_factor": rot / base["head_dim"],
            **common.gguf_sigmoid_routing(kv, arch, shared=1, leading=1, norm=True),
            "attention_bias": "blk.0.attn_q.bias" in names,
            "use_qk_norm": "blk.0.attn_q_norm.weight" in names,
        }
