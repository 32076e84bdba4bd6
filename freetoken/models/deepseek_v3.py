"""DeepSeek-V3 (DeepSeek-V3, V3.1, R1): multi-head latent attention
with YaRN rope, the first `first_k_dense_replace` layers a dense SwiGLU MLP, the rest routed
SwiGLU experts beside always-on shared experts; sigmoid grouped top-k routing with a
correction bias and routed scaling. DeepSeek-V2 (models/deepseek_v2.py) and GLM-4.7-Flash
(models/glm4_moe_lite.py) are this model with their own config readings.

Shapes: T = tokens in the step, H = hidden, E = routed experts.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import torch
from torch import nn

from freetoken.layers.mla import MLAttention
from freetoken.layers.mlp import GatedMLP
from freetoken.layers.moe import Experts, SigmoidGroupedTopK, SparseMoeBlock
from freetoken.layers.norm import RMSNorm
from freetoken.layers.rope_scaling import RopeScaling, ScaledRotaryEmbedding
from freetoken.layers.routers import Router
from freetoken.models import deepseek_gguf, hub
from freetoken.models.base import ExpertKey, ExpertSpec, KVLayout
from freetoken.models.decoder import DecoderModel

MODEL_TYPE = "deepseek_v3"
GGUF_ARCH = "deepseek2"


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    n_shared_experts: int = 0
    dense_layers: tuple[int, ...] = ()  # layers whose MLP is dense, not routed
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    rope_interleave: bool = True
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    split_kv_b: bool = False  # kv_b_proj as llama.cpp splits it (attn_k_b / attn_v_b)

    # the family's defaults for settings a config may leave out
    FIRST_DENSE: ClassVar[int] = 3

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> ModelArgs:
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in cfg.items() if k in names and v is not None}
        kw["num_experts"] = hub.num_experts(cfg)  # n_routed_experts (or num_local_experts)
        kw["rope_theta"] = hub.rope_theta(cfg)
        kw["rope_scaling"] = RopeScaling.from_params(
            hub.rope_parameters(cfg), int(cfg.get("max_position_embeddings") or 4096)
        )
        kw["q_lora_rank"] = cfg.get("q_lora_rank") or None
        kw["n_group"] = int(cfg.get("n_group") or 1)
        kw["topk_group"] = int(cfg.get("topk_group") or 1)
        kw["dense_layers"] = cls.dense_layers_of(cfg)
        return cls(**kw)

    @classmethod
    def dense_layers_of(cls, cfg: Mapping[str, Any]) -> tuple[int, ...]:
        first = cfg.get("first_k_dense_replace")
        return tuple(range(cls.FIRST_DENSE if first is None else int(first)))

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0 and i not in self.dense_layers

    @property
    def softmax_scale(self) -> float:
        return self.rope_scaling.softmax_scale(self.qk_nope_head_dim + self.qk_rope_head_dim)


def router_of(a: ModelArgs) -> Router:
    return SigmoidGroupedTopK(
        a.hidden_size,
        a.num_experts,
        a.num_experts_per_tok,
        n_group=a.n_group,
        topk_group=a.topk_group,
        norm_topk_prob=a.norm_topk_prob,
        routed_scaling=a.routed_scaling_factor,
    )


def attention_args(a: ModelArgs) -> dict[str, Any]:
    """MLAttention's settings from the args (beside its layer, hidden size and heads)."""
    return dict(
        q_lora_rank=a.q_lora_rank,
        kv_lora_rank=a.kv_lora_rank,
        qk_nope_head_dim=a.qk_nope_head_dim,
        qk_rope_head_dim=a.qk_rope_head_dim,
        v_head_dim=a.v_head_dim,
        scale=a.softmax_scale,
        bias=a.attention_bias,
        interleaved=a.rope_interleave,
        split_kv_b=a.split_kv_b,
    )


class DecoderLayer(nn.Module):
    def __init__(self, a: ModelArgs, i: int, router: Router | None):
        super().__init__()
        self.self_attn = self.attention(a, i)
        if router is not None:
            spec = ExpertSpec(a.hidden_size, a.moe_intermediate_size)
            shared = None
            if a.n_shared_experts:
                width = a.moe_intermediate_size * a.n_shared_experts
                shared = GatedMLP(a.hidden_size, width, bias=a.mlp_bias)
            self.mlp = SparseMoeBlock(router, Experts(i, a.num_experts, spec), shared)
        else:
            self.mlp = GatedMLP(a.hidden_size, a.intermediate_size, bias=a.mlp_bias)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    @staticmethod
    def attention(a: ModelArgs, i: int) -> nn.Module:
        return MLAttention(i, a.hidden_size, a.num_attention_heads, **attention_args(a))

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekModel(nn.Module):
    def __init__(self, a: ModelArgs, make_router=router_of, layer=DecoderLayer):
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(
            layer(a, i, make_router(a) if a.is_moe_layer(i) else None)
            for i in range(a.num_hidden_layers)
        )
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.rotary = ScaledRotaryEmbedding(a.qk_rope_head_dim, a.rope_theta, a.rope_scaling)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, H]
        rope = self.rotary(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, rope)
        return self.norm(x)


_EXPERT = re.compile(
    r"model\.layers\.(\d+)\.mlp\.experts\."
    r"(?:(\d+)\.(gate_proj|up_proj|down_proj)\.weight|(gate_up_proj|down_proj))$"
)


class Model(DecoderModel):
    """The family's model; DeepSeek-V2 and GLM-4.7-Flash subclass it with their own
    `Args`, router and names."""

    Args: ClassVar[type[ModelArgs]] = ModelArgs
    Stack: ClassVar[type[nn.Module]] = DeepseekModel
    GGUF_ARCH: ClassVar[str] = GGUF_ARCH
    # what a GGUF file of the architecture is: its model type when sigmoid-gated, and the
    # gating a file that names none has (llama.cpp: softmax, for the early DeepSeek-V2 files)
    GGUF_SIGMOID_TYPE: ClassVar[str] = MODEL_TYPE
    GGUF_GATING: ClassVar[int] = deepseek_gguf.GATING_SOFTMAX
    GATING: ClassVar[int] = deepseek_gguf.GATING_SIGMOID  # this model's routing, for show

    def __init__(self, args: ModelArgs):
        super().__init__(args, self.Stack(args, self.router_of))

    @staticmethod
    def router_of(a: ModelArgs) -> Router:
        return router_of(a)

    def layer_kv(self, i: int) -> KVLayout:
        return KVLayout.latent(self.args.kv_lora_rank + self.args.qk_rope_head_dim)

    @classmethod
    def model_info(cls, config: Mapping[str, Any]) -> dict[str, Any]:
        a = cls.Args.from_dict(config)
        return deepseek_gguf.model_info(cls.GGUF_ARCH, a, config, cls.GATING)

    @staticmethod
    def expert_key(name: str) -> ExpertKey | None:
        """Where a checkpoint tensor goes in the expert banks, or None for a dense weight:
        per-expert `experts.{e}.{gate,up,down}_proj.weight` (the Hub's) and transformers 5's
        fused `experts.gate_up_proj [E, 2I, H]` / `experts.down_proj [E, H, I]`."""
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
        return deepseek_gguf.gguf_key(name)

    @classmethod
    def config_from_gguf(cls, kv: Mapping[str, Any], arch: str) -> dict[str, Any]:
        return deepseek_gguf.config_from_gguf(kv, arch, cls.GGUF_SIGMOID_TYPE, cls.GGUF_GATING)
