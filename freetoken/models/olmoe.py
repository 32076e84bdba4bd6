"""OLMoE (OLMoE-1B-7B): GQA whose q and k are RMS-normalised over the whole projection
before the heads are split, optionally biased and clipped (clip_qkv), RoPE, softmax top-k
routing (renormalised only with norm_topk_prob) over SwiGLU experts of intermediate_size.

Shapes: T = tokens in the step, H = hidden, E = experts, k = experts per token.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from freetoken.layers.moe import Experts, SparseMoeBlock, TopKRouter
from freetoken.layers.rope import RotaryEmbedding
from freetoken.models import common, hub
from freetoken.models.base import ExpertSpec
from freetoken.models.decoder import DecoderLayer, DecoderModel, DecoderStack, attention

GGUF_ARCH = "olmoe"


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int  # each expert's
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool = False
    attention_bias: bool = False
    clip_qkv: float | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> ModelArgs:
        common.require_default_rope(cfg)
        return common.args_from(
            cls, cfg, num_experts=hub.num_experts(cfg), rope_theta=hub.rope_theta(cfg)
        )

    @property
    def head_dim(self) -> int:  # OLMoE's configs have no head_dim
        return self.hidden_size // self.num_attention_heads


def _layer(a: ModelArgs, i: int) -> DecoderLayer:
    attn = attention(a, i, qk_norm="full", bias=a.attention_bias, clip_qkv=a.clip_qkv)
    mlp = SparseMoeBlock(
        TopKRouter(a.hidden_size, a.num_experts, a.num_experts_per_tok, a.norm_topk_prob),
        Experts(i, a.num_experts, ExpertSpec(a.hidden_size, a.intermediate_size)),
    )
    return DecoderLayer(attn, mlp, a.hidden_size, a.rms_norm_eps)


class Model(DecoderModel):
    Args = ModelArgs

    def __init__(self, args: ModelArgs):
        rotary = RotaryEmbedding(args.head_dim, args.rope_theta)
        super().__init__(args, DecoderStack.of(args, _layer, rotary))

    @classmethod
    def model_info(cls, config: Mapping[str, Any]) -> dict[str, Any]:
        info = hub.standard_info(GGUF_ARCH, config)
        del info[f"{GGUF_ARCH}.expert_feed_forward_length"]  # olmoe's is feed_forward_length
        if config.get("clip_qkv"):
            info[f"{GGUF_ARCH}.attention.clamp_kqv"] = float(config["clip_qkv"])
        return info

    @staticmethod
    def config_from_gguf(kv: Mapping[str, Any], arch: str) -> dict[str, Any]:
        """A Hub-style config.json from GGUF metadata."""
        clip = kv.get(f"{arch}.attention.clamp_kqv")
        return {
            **common.gguf_base_config(kv, arch),
            "architectures": ["OlmoeForCausalLM"],
            "model_type": "olmoe",
            "num_experts": int(kv[f"{arch}.expert_count"]),
            # llama.cpp weights olmoe's top-k by their softmax probabilities as they are
            "norm_topk_prob": False,
            "clip_qkv": float(clip) if clip else None,
        }
