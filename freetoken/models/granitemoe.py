"""Granite MoE (granite-3.0 / 3.1 MoE: 1B-A400M, 3B-A800M): Mixtral's shape (GQA, RoPE, a
softmax over the router's top-k logits, SwiGLU experts) with four multipliers: the
embeddings are scaled by `embedding_multiplier`, each sublayer's output by
`residual_multiplier` before it is added to the residual stream, q·k by
`attention_multiplier` (in place of 1/√head_dim), and the logits are divided by
`logits_scaling`.

Hub checkpoints keep each layer's experts whole: `block_sparse_moe.input_linear` [E, 2I, H]
(gate rows, then up) and `output_linear` [E, H, I], and the router as
`block_sparse_moe.router.layer`. llama.cpp's `granitemoe` GGUF splits gate and up, names
the multipliers (attention.scale, embedding_scale, residual_scale, logit_scale) and, as for
its llama files, permutes each head's q/k rows for GGML's rope (`rope_pairs`).

Shapes: T = tokens in the step, H = hidden, E = experts.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from freetoken.layers.moe import Experts, SparseMoeBlock, TopKRouter
from freetoken.layers.norm import RMSNorm
from freetoken.layers.rope import RotaryEmbedding
from freetoken.models import common, hub
from freetoken.models.base import ExpertKey, ExpertSpec
from freetoken.models.decoder import DecoderModel, DecoderStack, attention

GGUF_ARCH = "granitemoe"


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
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    logits_scaling: float = 1.0
    attention_bias: bool = False
    head_dim: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_pairs: bool = False  # q/k rows permuted as llama.cpp writes them (GGUF only)
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 4096

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> ModelArgs:
        common.require_default_rope(cfg)
        return common.args_from(
            cls,
            cfg,
            num_local_experts=hub.num_experts(cfg),
            rope_theta=hub.rope_theta(cfg),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        )


class GraniteLayer(nn.Module):
    """x + m·self_attn(input_layernorm(x)), then + m·mlp(post_attention_layernorm(x)), m
    the residual multiplier."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, a: ModelArgs):
        super().__init__()
        self.self_attn, self.mlp = self_attn, mlp
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.residual = a.residual_multiplier

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x + self.residual * self.self_attn(self.input_layernorm(x), rope)
        return x + self.residual * self.mlp(self.post_attention_layernorm(x))


class GraniteStack(DecoderStack):
    """The decoder stack, its embeddings scaled by the embedding multiplier."""

    def __init__(self, a: ModelArgs, layers: list[nn.Module], rotary: RotaryEmbedding):
        super().__init__(a.vocab_size, a.hidden_size, layers, a.rms_norm_eps, rotary)
        self.embedding_multiplier = a.embedding_multiplier

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embedding_multiplier


def _layer(a: ModelArgs, i: int) -> GraniteLayer:
    attn = attention(
        a, i, bias=a.attention_bias, rope_pairs=a.rope_pairs, scale=a.attention_multiplier
    )
    # a softmax over the top-k logits: TopKRouter's renormalising form
    mlp = SparseMoeBlock(
        TopKRouter(a.hidden_size, a.num_local_experts, a.num_experts_per_tok, True),
        Experts(i, a.num_local_experts, ExpertSpec(a.hidden_size, a.intermediate_size)),
    )
    return GraniteLayer(attn, mlp, a)


_BANKS = re.compile(r"model\.layers\.(\d+)\.block_sparse_moe\.(input_linear|output_linear)\.weight")


class Model(DecoderModel):
    Args = ModelArgs

    def __init__(self, args: ModelArgs):
        layers = [_layer(args, i) for i in range(args.num_hidden_layers)]
        rotary = RotaryEmbedding(args.head_dim, args.rope_theta, pairs=args.rope_pairs)
        super().__init__(args, GraniteStack(args, layers, rotary))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden) / self.args.logits_scaling

    dense_key = staticmethod(
        common.renamer(
            (r"\.block_sparse_moe\.router\.layer\.", ".mlp.gate."),
            (r"\.block_sparse_moe\.", ".mlp."),
        )
    )

    @staticmethod
    def expert_key(name: str) -> ExpertKey | None:
        m = _BANKS.fullmatch(name)
        if m is None:
            return None
        return ExpertKey(int(m.group(1)), "gate_up" if m.group(2) == "input_linear" else "down")

    @classmethod
    def model_info(cls, config: Mapping[str, Any]) -> dict[str, Any]:
        a, p = ModelArgs.from_dict(config), f"{GGUF_ARCH}."
        info = hub.standard_info(GGUF_ARCH, config)
        info[p + "expert_feed_forward_length"] = a.intermediate_size
        return info | {
            p + "attention.scale": a.attention_multiplier,
            p + "embedding_scale": a.embedding_multiplier,
            p + "residual_scale": a.residual_multiplier,
            p + "logit_scale": a.logits_scaling,
        }

    @staticmethod
    def config_from_gguf(kv: Mapping[str, Any], arch: str) -> dict[str, Any]:
        def g(key: str, default: Any = None) -> Any:
            return kv.get(f"{arch}.{key}", default)

        base = common.gguf_base_config(kv, arch)
        return {
            **base,
            "architectures": ["GraniteMoeForCausalLM"],
            "model_type": "granitemoe",
            "num_local_experts": int(g("expert_count")),
            "intermediate_size": int(g("expert_feed_forward_length", base["intermediate_size"])),
            "attention_multiplier": float(g("attention.scale", base["head_dim"] ** -0.5)),
            "embedding_multiplier": float(g("embedding_scale", 1.0)),
            "residual_multiplier": float(g("residual_scale", 1.0)),
            "logits_scaling": float(g("logit_scale", 1.0)),
            "rope_pairs": True,
        }
