"""MiniMax-M2, as transformers defines it: GQA whose q and k are RMS-normalised over the
whole projection (qk_norm_type "per_layer"), partial rotary (rotary_dim of head_dim),
sigmoid routing: top-k by score plus a correction bias, weighted by the plain scores
renormalised, over SwiGLU experts of intermediate_size; no shared expert, no window.

Hub checkpoints name the MoE block `block_sparse_moe` (experts w1/w3/w2, the correction
bias beside the router); transformers 5 and this model call it `mlp`, the bias the
router's own.

Shapes: T = tokens in the step, H = hidden, E = experts, k = experts per token.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from freetoken.layers.moe import Experts, SigmoidGroupedTopK, SparseMoeBlock
from freetoken.layers.rope import RotaryEmbedding
from freetoken.models import common, hub
from freetoken.models.base import ExpertSpec
from freetoken.models.decoder import DecoderLayer, DecoderModel, DecoderStack, attention

GGUF_ARCH = "minimax-m2"


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int  # each expert's
    num_local_experts: int
    num_experts_per_tok: int
    rotary_dim: int = 0
    use_routing_bias: bool = True
    rms_norm_eps: float = 1e-6
    rope_theta: float = 5e6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 196608

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> ModelArgs:
        common.require_default_rope(cfg)
        _check_supported(cfg)
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        return common.args_from(
            cls,
            cfg,
            head_dim=head_dim,
            rotary_dim=common.rotary_dim(cfg, head_dim),
            num_local_experts=hub.num_experts(cfg),
            rope_theta=hub.rope_theta(cfg, 5e6),
        )


def _check_supported(cfg: Mapping[str, Any]) -> None:
    """The config options transformers' MiniMax-M2 does not implement, refused rather than
    computed otherwise."""
    unsupported = {
        "qk_norm_type": cfg.get("qk_norm_type", "per_layer") != "per_layer",
        "use_qk_norm": cfg.get("use_qk_norm", True) is False,
        "scoring_func": cfg.get("scoring_func", "sigmoid") != "sigmoid",
        "shared_intermediate_size": bool(cfg.get("shared_intermediate_size")),
        "attn_type_list": any(t != 1 for t in cfg.get("attn_type_list") or ()),
    }
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise ValueError(f"unsupported MiniMax-M2 settings: {', '.join(bad)}")


def _layer(a: ModelArgs, i: int) -> DecoderLayer:
    attn = attention(a, i, qk_norm="full")
    router = SigmoidGroupedTopK(
        a.hidden_size,
        a.num_local_experts,
        a.num_experts_per_tok,
        norm_topk_prob=True,
        correction_bias=a.use_routing_bias,
    )
    spec = ExpertSpec(a.hidden_size, a.intermediate_size)
    mlp = SparseMoeBlock(router, Experts(i, a.num_local_experts, spec))
    return DecoderLayer(attn, mlp, a.hidden_size, a.rms_norm_eps)


class Model(DecoderModel):
    Args = ModelArgs

    def __init__(self, args: ModelArgs):
        rotary = RotaryEmbedding(args.rotary_dim, args.rope_theta)
        super().__init__(args, DecoderStack.of(args, _layer, rotary))

    dense_key = staticmethod(
        common.renamer(
            (r"\.block_sparse_moe\.", ".mlp."),
            (r"\.mlp\.e_score_correction_bias$", ".mlp.gate.e_score_correction_bias"),
        )
    )
    expert_key = staticmethod(common.ExpertNames("block_sparse_moe", "w1", "w3", "w2"))

    @classmethod
    def model_info(cls, config: Mapping[str, Any]) -> dict[str, Any]:
        a = ModelArgs.from_dict(config)
        info = hub.standard_info(GGUF_ARCH, config)
        info[f"{GGUF_ARCH}.expert_feed_forward_length"] = a.intermediate_size
        info[f"{GGUF_ARCH}.rope.dimension_count"] = a.rotary_dim
        info[f"{GGUF_ARCH}.expert_gating_func"] = common.SIGMOID_GATING
        return info

    @staticmethod
    def config_from_gguf(kv: Mapping[str, Any], arch: str) -> dict[str, Any]:
        """A Hub-style config.json from GGUF metadata."""
        base = common.gguf_base_config(kv, arch)
        common.require_sigmoid_gating(kv, arch)
        return {
            **base,
            "architectures": ["MiniMaxM2ForCausalLM"],
            "model_type": "minimax_m2",
            "intermediate_size": int(kv.get(f"{arch}.expert_feed_forward_length")),
            "rotary_dim": int(kv.get(f"{arch}.rope.dimension_count", base["head_dim"])),
            "num_local_experts": int(kv[f"{arch}.expert_count"]),
        }
