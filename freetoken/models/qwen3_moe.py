"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B, ...): GQA with per-head q/k RMSNorm, RoPE,
softmax top-k routing over SwiGLU experts, optional dense MLP layers.

Shapes: T = tokens in the step, H = hidden, E = experts, k = experts per token.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from freetoken.layers.mlp import GatedMLP
from freetoken.layers.moe import Experts, SparseMoeBlock, TopKRouter
from freetoken.layers.rope import RotaryEmbedding
from freetoken.models import common, hub
from freetoken.models.base import ExpertSpec
from freetoken.models.decoder import DecoderLayer, DecoderModel, DecoderStack, attention

GGUF_ARCH = "qwen3moe"


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    intermediate_size: int = 0
    head_dim: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = field(default_factory=tuple)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> ModelArgs:
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in cfg.items() if k in names and v is not None}
        kw["num_experts"] = hub.num_experts(cfg)  # num_experts or num_local_experts
        kw["rope_theta"] = hub.rope_theta(cfg)  # top-level or rope_parameters
        kw["mlp_only_layers"] = tuple(cfg.get("mlp_only_layers") or ())
        if not kw.get("head_dim"):
            kw["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"]
        return cls(**kw)

    def is_moe_layer(self, i: int) -> bool:
        return (
            self.num_experts > 0
            and i not in self.mlp_only_layers
            and (i + 1) % self.decoder_sparse_step == 0
        )


def _layer(a: ModelArgs, i: int) -> DecoderLayer:
    attn = attention(a, i, qk_norm=True, bias=a.attention_bias)
    if a.is_moe_layer(i):
        spec = ExpertSpec(a.hidden_size, a.moe_intermediate_size)
        mlp = SparseMoeBlock(
            TopKRouter(a.hidden_size, a.num_experts, a.num_experts_per_tok, a.norm_topk_prob),
            Experts(i, a.num_experts, spec),
        )
    else:
        mlp = GatedMLP(a.hidden_size, a.intermediate_size)
    return DecoderLayer(attn, mlp, a.hidden_size, a.rms_norm_eps)


class Model(DecoderModel):
    Args = ModelArgs

    def __init__(self, args: ModelArgs):
        rotary = RotaryEmbedding(args.head_dim, args.rope_theta)
        super().__init__(args, DecoderStack.of(args, _layer, rotary))

    @classmethod
    def model_info(cls, config: Mapping[str, Any]) -> dict[str, Any]:
        return hub.standard_info(GGUF_ARCH, config)

    @staticmethod
    def config_from_gguf(kv: Mapping[str, Any], arch: str) -> dict[str, Any]:
        """A Hub-style config.json from GGUF metadata."""
        return {
            **common.gguf_base_config(kv, arch),
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "moe_intermediate_size": int(kv[f"{arch}.expert_feed_forward_length"]),
            "num_experts": int(kv[f"{arch}.expert_count"]),
            # llama.cpp always renormalises the top-k weights of qwen3moe
            "norm_topk_prob": True,
        }
