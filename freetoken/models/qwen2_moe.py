"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): GQA with q/k/v biases, RoPE, softmax
top-k routing (not renormalised unless norm_topk_prob) over SwiGLU experts, plus one shared
expert scaled by a sigmoid gate; optional dense MLP layers and sliding-window layers.

Shapes: T = tokens in the step, H = hidden, E = experts, k = experts per token.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from freetoken.layers.mlp import GatedMLP
from freetoken.layers.moe import Experts, SparseMoeBlock, TopKRouter
from freetoken.layers.rope import RotaryEmbedding
from freetoken.models import common, hub
from freetoken.models.base import ExpertSpec
from freetoken.models.decoder import DecoderLayer, DecoderModel, DecoderStack, attention

GGUF_ARCH = "qwen2moe"
SLIDING = "sliding_attention"


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    intermediate_size: int = 0
    head_dim: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = field(default_factory=tuple)
    qkv_bias: bool = True  # absent from the Hub's configs: Qwen2-MoE always has them
    use_sliding_window: bool = False
    sliding_window: int = 0
    max_window_layers: int = 0
    layer_types: tuple[str, ...] = field(default_factory=tuple)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> ModelArgs:
        common.require_default_rope(cfg)
        n = cfg["num_hidden_layers"]
        types = cfg.get("layer_types")
        if not types:  # transformers' rule: every other layer below max_window_layers
            window_layers = cfg.get("max_window_layers") or 0
            types = [
                SLIDING
                if cfg.get("use_sliding_window") and i % 2 == 0 and i < window_layers
                else "full_attention"
                for i in range(n)
            ]
        return common.args_from(
            cls,
            cfg,
            num_experts=hub.num_experts(cfg),
            rope_theta=hub.rope_theta(cfg),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
            layer_types=tuple(types),
        )

    def is_moe_layer(self, i: int) -> bool:
        return (
            self.num_experts > 0
            and i not in self.mlp_only_layers
            and (i + 1) % self.decoder_sparse_step == 0
        )

    def window(self, i: int) -> int:
        sliding = self.use_sliding_window and self.layer_types[i] == SLIDING
        return self.sliding_window if sliding and self.sliding_window else 0


def _layer(a: ModelArgs, i: int) -> DecoderLayer:
    attn = attention(a, i, bias=a.qkv_bias, o_bias=False, window=a.window(i))
    if a.is_moe_layer(i):
        mlp = SparseMoeBlock(
            TopKRouter(a.hidden_size, a.num_experts, a.num_experts_per_tok, a.norm_topk_prob),
            Experts(i, a.num_experts, ExpertSpec(a.hidden_size, a.moe_intermediate_size)),
            shared_experts=GatedMLP(a.hidden_size, a.shared_expert_intermediate_size),
            shared_gate=nn.Linear(a.hidden_size, 1, bias=False),
        )
    else:
        mlp = GatedMLP(a.hidden_size, a.intermediate_size)
    return DecoderLayer(attn, mlp, a.hidden_size, a.rms_norm_eps)


class Model(DecoderModel):
    Args = ModelArgs

    def __init__(self, args: ModelArgs):
        rotary = RotaryEmbedding(args.head_dim, args.rope_theta)
        super().__init__(args, DecoderStack.of(args, _layer, rotary))

    # checkpoints call the shared expert and its gate mlp.shared_expert(_gate)
    dense_key = staticmethod(
        common.renamer(
            (r"\.mlp\.shared_expert_gate\.", ".mlp.shared_gate."),
            (r"\.mlp\.shared_expert\.", ".mlp.shared_experts."),
        )
    )

    @classmethod
    def model_info(cls, config: Mapping[str, Any]) -> dict[str, Any]:
        a = ModelArgs.from_dict(config)
        info = hub.standard_info(GGUF_ARCH, config)
        info[f"{GGUF_ARCH}.expert_shared_feed_forward_length"] = a.shared_expert_intermediate_size
        windows = {a.window(i) for i in range(a.num_hidden_layers)} - {0}
        if windows:
            info[f"{GGUF_ARCH}.attention.sliding_window"] = max(windows)
        return info

    @staticmethod
    def config_from_gguf(kv: Mapping[str, Any], arch: str) -> dict[str, Any]:
        """A Hub-style config.json from GGUF metadata."""

        def g(key: str, default: Any = None) -> Any:
            return kv.get(f"{arch}.{key}", default)

        return {
            **common.gguf_base_config(kv, arch),
            "architectures": ["Qwen2MoeForCausalLM"],
            "model_type": "qwen2_moe",
            "moe_intermediate_size": int(g("expert_feed_forward_length")),
            "shared_expert_intermediate_size": int(g("expert_shared_feed_forward_length")),
            "num_experts": int(g("expert_count")),
            # llama.cpp weights qwen2moe's top-k by their softmax probabilities as they are
            "norm_topk_prob": False,
            "qkv_bias": True,
        }
