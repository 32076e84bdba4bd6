"""Mixtral (8x7B, 8x22B): GQA without biases, RoPE, top-2 of the softmaxed router logits
(renormalised) over SwiGLU experts, optionally sliding-window attention on every layer.

Hub checkpoints name the MoE block `block_sparse_moe` and the experts' projections w1
(gate), w3 (up), w2 (down); transformers 5 calls the block `mlp`, and so does this model.
llama.cpp writes Mixtral as its `llama` architecture with expert tensors, and permutes the
q/k rows of each head for GGML's rope: a model from such a file rotates pairs of dimensions
(`rope_pairs`, set by config_from_gguf), which gives the same attention.

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

GGUF_ARCH = "llama"


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int  # each expert's
    num_local_experts: int
    num_experts_per_tok: int
    head_dim: int = 0
    sliding_window: int = 0
    rms_norm_eps: float = 1e-5
    rope_theta: float = 1e6
    rope_pairs: bool = False  # q/k rows permuted as llama.cpp writes them (GGUF only)
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> ModelArgs:
        common.require_default_rope(cfg)
        return common.args_from(
            cls,
            cfg,
            num_local_experts=hub.num_experts(cfg),
            rope_theta=hub.rope_theta(cfg, 1e6),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        )


def _layer(a: ModelArgs, i: int) -> DecoderLayer:
    attn = attention(a, i, rope_pairs=a.rope_pairs, window=a.sliding_window)
    mlp = SparseMoeBlock(
        TopKRouter(a.hidden_size, a.num_local_experts, a.num_experts_per_tok, True),
        Experts(i, a.num_local_experts, ExpertSpec(a.hidden_size, a.intermediate_size)),
    )
    return DecoderLayer(attn, mlp, a.hidden_size, a.rms_norm_eps)


class Model(DecoderModel):
    Args = ModelArgs

    def __init__(self, args: ModelArgs):
        rotary = RotaryEmbedding(args.head_dim, args.rope_theta, pairs=args.rope_pairs)
        super().__init__(args, DecoderStack.of(args, _layer, rotary))

    dense_key = staticmethod(common.renamer((r"\.block_sparse_moe\.", ".mlp.")))
    expert_key = staticmethod(common.ExpertNames("block_sparse_moe", "w1", "w3", "w2"))

    @classmethod
    def model_info(cls, config: Mapping[str, Any]) -> dict[str, Any]:
        a = ModelArgs.from_dict(config)
        info = hub.standard_info(GGUF_ARCH, config)
        del info[f"{GGUF_ARCH}.expert_feed_forward_length"]  # llama's is feed_forward_length
        info[f"{GGUF_ARCH}.rope.dimension_count"] = a.head_dim
        if a.sliding_window:
            info[f"{GGUF_ARCH}.attention.sliding_window"] = a.sliding_window
        return info

    @staticmethod
    def config_from_gguf(kv: Mapping[str, Any], arch: str) -> dict[str, Any]:
        """A Hub-style config.json from a llama-architecture GGUF with experts."""
        experts = int(kv.get(f"{arch}.expert_count", 0))
        if not experts:
            raise ValueError(f"a dense {arch} GGUF: only its MoE form (Mixtral) is supported")
        base = common.gguf_base_config(kv, arch)
        rot = int(kv.get(f"{arch}.rope.dimension_count", base["head_dim"]))
        if rot != base["head_dim"]:
            raise ValueError(f"partial rotary ({rot} of {base['head_dim']}) in a {arch} GGUF")
        return {
            **base,
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "num_local_experts": experts,
            "sliding_window": int(kv.get(f"{arch}.attention.sliding_window", 0)) or None,
            "rope_pairs": True,
        }
