"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B, ...): GQA with per-head q/k RMSNorm, RoPE,
softmax top-k routing over SwiGLU experts, optional dense MLP layers.

Shapes: T = tokens in the step, H = hidden, E = experts, k = experts per token.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import nn

from freetoken.layers.attention import Attention
from freetoken.layers.mlp import GatedMLP
from freetoken.layers.moe import Experts, SparseMoeBlock, TopKRouter
from freetoken.layers.norm import RMSNorm
from freetoken.layers.rope import RotaryEmbedding
from freetoken.models import hub
from freetoken.models.base import ExpertKey, ExpertSpec, KVLayout
from freetoken.models.decoder import DecoderModel

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


class DecoderLayer(nn.Module):
    def __init__(self, a: ModelArgs, i: int):
        super().__init__()
        self.self_attn = Attention(
            i,
            a.hidden_size,
            a.num_attention_heads,
            a.num_key_value_heads,
            a.head_dim,
            qk_norm=True,
            bias=a.attention_bias,
            eps=a.rms_norm_eps,
        )
        if a.is_moe_layer(i):
            spec = ExpertSpec(a.hidden_size, a.moe_intermediate_size)
            self.mlp = SparseMoeBlock(
                TopKRouter(a.hidden_size, a.num_experts, a.num_experts_per_tok, a.norm_topk_prob),
                Experts(i, a.num_experts, spec),
            )
        else:
            self.mlp = GatedMLP(a.hidden_size, a.intermediate_size)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3MoeModel(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(a, i) for i in range(a.num_hidden_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.rotary = RotaryEmbedding(a.head_dim, a.rope_theta)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, H]
        rope = self.rotary(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, rope)
        return self.norm(x)


# GGUF tensor names (llama.cpp's qwen3moe) -> this model's names; experts map to banks.
GGUF_DENSE = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GGUF_EXPERTS = {
    "ffn_gate_exps": ("gate_up", 0),
    "ffn_up_exps": ("gate_up", 1),
    "ffn_down_exps": ("down", None),
}

_EXPERT = re.compile(
    r"model\.layers\.(\d+)\.mlp\.experts\."
    r"(?:(\d+)\.(gate_proj|up_proj|down_proj)\.weight|(gate_up_proj|down_proj))$"
)


class Model(DecoderModel):
    Args = ModelArgs

    def __init__(self, args: ModelArgs):
        super().__init__(args, Qwen3MoeModel(args))

    def layer_kv(self, i: int) -> KVLayout:
        return KVLayout.attention(self.args.num_key_value_heads, self.args.head_dim)

    @classmethod
    def model_info(cls, config: Mapping[str, Any]) -> dict[str, Any]:
        return hub.standard_info(GGUF_ARCH, config)

    @staticmethod
    def expert_key(name: str) -> ExpertKey | None:
        """Where a checkpoint tensor goes in the expert banks, or None for a dense weight.

        Both layouts are read: per-expert `experts.{e}.{gate,up,down}_proj.weight` (the Hub's)
        and fused `experts.gate_up_proj [E, 2I, H]` / `experts.down_proj [E, H, I]`.
        """
        m = _EXPERT.fullmatch(name)
        if not m:
            return None
        layer = int(m.group(1))
        if m.group(4):
            return ExpertKey(layer, "gate_up" if m.group(4) == "gate_up_proj" else "down")
        part = m.group(3)
        bank = "down" if part == "down_proj" else "gate_up"
        half = {"gate_proj": 0, "up_proj": 1}.get(part)
        return ExpertKey(layer, bank, expert=int(m.group(2)), half=half)

    @staticmethod
    def gguf_key(name: str) -> str | ExpertKey:
        """This model's name for a GGUF tensor, or the bank it belongs to."""
        parts = name.split(".")
        if parts[0] != "blk":
            return f"{GGUF_DENSE[parts[0]]}.{parts[-1]}"
        layer, kind = int(parts[1]), parts[2]
        if kind in GGUF_EXPERTS:
            bank, half = GGUF_EXPERTS[kind]
            return ExpertKey(layer, bank, expert=None, half=half)
        return f"model.layers.{layer}.{GGUF_DENSE[kind]}.{parts[-1]}"

    @staticmethod
    def config_from_gguf(kv: Mapping[str, Any], arch: str) -> dict[str, Any]:
        """A Hub-style config.json from GGUF metadata."""

        def g(key: str, default: Any = None) -> Any:
            return kv.get(f"{arch}.{key}", default)

        heads = int(g("attention.head_count"))
        return {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "hidden_size": int(g("embedding_length")),
            "num_hidden_layers": int(g("block_count")),
            "intermediate_size": int(g("feed_forward_length", 0)),
            "moe_intermediate_size": int(g("expert_feed_forward_length")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(g("attention.head_count_kv", heads)),
            "head_dim": int(g("attention.key_length", int(g("embedding_length")) // heads)),
            "num_experts": int(g("expert_count")),
            "num_experts_per_tok": int(g("expert_used_count")),
            # llama.cpp always renormalises the top-k weights of qwen3moe
            "norm_topk_prob": True,
            "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(g("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(g("context_length", 4096)),
        }
