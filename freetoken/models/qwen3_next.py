"""Qwen3-Next (Qwen3-Next-80B-A3B): a hybrid whose layers are mostly Gated DeltaNet (linear
attention with a recurrent state, layers/deltanet.py) and every `full_attention_interval`-th
one gated attention (GQA with per-head q/k norms, partial rotary and a sigmoid output gate
from q_proj), as `layer_types` lists them; MoE layers with softmax top-k routing over SwiGLU
experts plus a shared expert scaled by a sigmoid gate. Its RMSNorms are zero-centred (they
scale by 1 + weight), the DeltaNet's gated output norm excepted.

A DeltaNet layer keeps no per-token cache: its KV layout is `recurrent`, a conv state and a
recurrent state per sequence, which the runtime keeps in state slots.

Shapes: T = tokens in the step, H = hidden, E = experts, k = experts per token.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from freetoken.layers.deltanet import GatedDeltaNet
from freetoken.layers.mlp import GatedMLP
from freetoken.layers.moe import Experts, SparseMoeBlock, TopKRouter
from freetoken.layers.norm import RMSNorm
from freetoken.layers.rope import RotaryEmbedding
from freetoken.models import common, hub
from freetoken.models.base import GGUF_TENSORS, ExpertSpec, KVLayout
from freetoken.models.decoder import DecoderModel, DecoderStack, attention

GGUF_ARCH = "qwen3next"
LINEAR = "linear_attention"
FULL = "full_attention"


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    layer_types: tuple[str, ...]
    head_dim: int = 256
    rotary_dim: int = 64
    linear_conv_kernel_dim: int = 4
    intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = field(default_factory=tuple)
    attention_bias: bool = False
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    # the DeltaNet's input projections (layers/deltanet.py): the Hub's "grouped", or what a
    # GGUF file holds (its config says so)
    linear_projections: str = "grouped"

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> ModelArgs:
        common.require_default_rope(cfg)
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        return common.args_from(
            cls,
            cfg,
            num_experts=hub.num_experts(cfg),
            rope_theta=hub.rope_theta(cfg),
            head_dim=head_dim,
            # transformers' default for configs that name no factor
            rotary_dim=common.rotary_dim(cfg, head_dim, default_factor=0.25),
            layer_types=tuple(layer_types(cfg)),
        )

    def is_moe_layer(self, i: int) -> bool:
        return (
            self.num_experts > 0
            and i not in self.mlp_only_layers
            and (i + 1) % self.decoder_sparse_step == 0
        )

    def is_linear(self, i: int) -> bool:
        return self.layer_types[i] == LINEAR


def layer_types(cfg: Mapping[str, Any]) -> list[str]:
    """`layer_types`, or every `full_attention_interval`-th layer attention (default 4)."""
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    every = int(cfg.get("full_attention_interval") or 4)
    return [FULL if (i + 1) % every == 0 else LINEAR for i in range(cfg["num_hidden_layers"])]


class HybridLayer(nn.Module):
    """x + mixer(input_layernorm(x)), then + mlp(post_attention_layernorm(x)); the mixer is
    `linear_attn` (Gated DeltaNet) or `self_attn` (gated attention), as checkpoints name
    them."""

    def __init__(self, mixer: nn.Module, mlp: nn.Module, hidden: int, eps: float):
        super().__init__()
        self.linear = isinstance(mixer, GatedDeltaNet)
        if self.linear:
            self.linear_attn = mixer
        else:
            self.self_attn = mixer
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden, eps, zero_centered=True)
        self.post_attention_layernorm = RMSNorm(hidden, eps, zero_centered=True)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h = self.input_layernorm(x)
        x = x + (self.linear_attn(h) if self.linear else self.self_attn(h, rope))
        return x + self.mlp(self.post_attention_layernorm(x))


def mixer(a: ModelArgs, i: int, projections: str) -> nn.Module:
    if a.is_linear(i):
        return GatedDeltaNet(
            i,
            a.hidden_size,
            a.linear_num_key_heads,
            a.linear_num_value_heads,
            a.linear_key_head_dim,
            a.linear_value_head_dim,
            a.linear_conv_kernel_dim,
            a.rms_norm_eps,
            projections=projections,
        )
    return attention(a, i, qk_norm=True, bias=a.attention_bias, gate=True, zero_centered=True)


def moe_block(a: ModelArgs, i: int) -> SparseMoeBlock:
    return SparseMoeBlock(
        TopKRouter(a.hidden_size, a.num_experts, a.num_experts_per_tok, a.norm_topk_prob),
        Experts(i, a.num_experts, ExpertSpec(a.hidden_size, a.moe_intermediate_size)),
        shared_experts=GatedMLP(a.hidden_size, a.shared_expert_intermediate_size),
        shared_gate=nn.Linear(a.hidden_size, 1, bias=False),
    )


def _layer(a: ModelArgs, i: int) -> HybridLayer:
    mlp = moe_block(a, i) if a.is_moe_layer(i) else GatedMLP(a.hidden_size, a.intermediate_size)
    return HybridLayer(mixer(a, i, a.linear_projections), mlp, a.hidden_size, a.rms_norm_eps)


# checkpoints call the shared expert and its gate mlp.shared_expert(_gate)
_SHARED = (
    (r"\.mlp\.shared_expert_gate\.", ".mlp.shared_gate."),
    (r"\.mlp\.shared_expert\.", ".mlp.shared_experts."),
)
# llama.cpp's names for the DeltaNet's tensors; `ssm_in` is the fused q/k/v/z projection as
# the Hub has it, which older converters kept whole (newer ones split it: attn_qkv, attn_gate)
_GGUF_LAYER = {
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_in": "linear_attn.in_proj_qkvz",
    "ssm_ba": "linear_attn.in_proj_ba",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
}
_GGUF_WHOLE = {("ssm_a", "ssm_a"): "linear_attn.A_log", ("ssm_dt", "bias"): "linear_attn.dt_bias"}


# multi-token-prediction weights, which no step runs
_IGNORED = re.compile(r"mtp\.")


class Model(DecoderModel):
    Args = ModelArgs

    def __init__(self, args: ModelArgs):
        stack = DecoderStack.of(
            args, self.build_layer, RotaryEmbedding(args.rotary_dim, args.rope_theta)
        )
        stack.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, zero_centered=True)
        super().__init__(args, stack)

    build_layer = staticmethod(_layer)

    def layer_kv(self, i: int) -> KVLayout:
        layer = self.model.layers[i]
        if layer.linear:
            return KVLayout("recurrent", state=layer.linear_attn.state_shapes)
        return KVLayout.attention(self.args.num_key_value_heads, self.args.head_dim)

    dense_key = staticmethod(common.renamer(*_SHARED))

    @classmethod
    def ignored(cls, name: str, config: Mapping[str, Any]) -> bool:
        return _IGNORED.match(name) is not None or super().ignored(name, config)

    @classmethod
    def model_info(cls, config: Mapping[str, Any]) -> dict[str, Any]:
        return hybrid_info(GGUF_ARCH, config, ModelArgs.from_dict(config))

    gguf_key = staticmethod(common.GgufNames(_GGUF_LAYER, _GGUF_WHOLE))

    @staticmethod
    def gguf_tensor(
        key: str, t: torch.Tensor, fmt: str | None, config: Mapping[str, Any]
    ) -> tuple[torch.Tensor, str | None]:
        return gguf_values(key, t), fmt

    @staticmethod
    def config_from_gguf(kv: Mapping[str, Any], arch: str) -> dict[str, Any]:
        return gguf_config(kv, arch)


def gguf_values(key: str, t: torch.Tensor) -> torch.Tensor:
    """Undoes what llama.cpp's (and Ollama's) converters do to these values: they store
    −e^{A_log} for A_log, the norms' weights plus one (their RMSNorm is not zero-centred; the
    DeltaNet's gated norm is, there and here) and the conv kernel without its middle axis.
    (These tensors are never packed: one-dimensional, or K = 4 columns wide.)"""
    if key.endswith(".linear_attn.A_log"):
        return torch.log(-t.float()).to(t.dtype)
    if key.endswith(".linear_attn.conv1d.weight"):
        return t.unsqueeze(1)
    if key.endswith("norm.weight") and not key.endswith(".linear_attn.norm.weight"):
        return t - 1
    return t


def gguf_config(kv: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """A Hub-style config from a `qwen3next` file's metadata (its ssm.* keys describe the
    DeltaNet layers); which layers are MoE and how the DeltaNet's projections are laid out
    come from its tensor names."""

    def g(key: str, default: Any = None) -> Any:
        return kv.get(f"{arch}.{key}", default)

    base = common.gguf_base_config(kv, arch)
    # multi-token-prediction layers are counted in block_count (Qwen3.5's, Ollama's files)
    base["num_hidden_layers"] -= int(g("nextn_predict_layers", 0))
    names = set(kv.get(GGUF_TENSORS) or ())
    layers = range(base["num_hidden_layers"])
    v_heads = int(g("ssm.time_step_rank"))
    routed = [i for i in layers if f"blk.{i}.ffn_gate_inp.weight" in names] if names else layers
    fused = any(n.endswith(".ssm_in.weight") for n in names)
    return {
        **base,
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "rotary_dim": int(g("rope.dimension_count", base["head_dim"])),
        "full_attention_interval": int(g("full_attention_interval", 4)),
        "linear_conv_kernel_dim": int(g("ssm.conv_kernel")),
        "linear_key_head_dim": int(g("ssm.state_size")),
        "linear_num_key_heads": int(g("ssm.group_count")),
        "linear_num_value_heads": v_heads,
        "linear_value_head_dim": int(g("ssm.inner_size")) // v_heads,
        "linear_projections": "grouped" if fused else "split_qkvz",
        "num_experts": int(g("expert_count")),
        "moe_intermediate_size": int(g("expert_feed_forward_length")),
        "shared_expert_intermediate_size": int(g("expert_shared_feed_forward_length", 0)),
        # llama.cpp's key, or Ollama's
        "norm_topk_prob": bool(g("expert_weights_norm", g("norm_top_k_prob", True))),
        "mlp_only_layers": [i for i in layers if i not in routed],
        "attention_bias": any(n.endswith(".attn_q.bias") for n in names),
    }


def hybrid_info(arch: str, config: Mapping[str, Any], a: ModelArgs) -> dict[str, Any]:
    """`show`'s keys, as llama.cpp names them for these hybrids (the ssm.* keys describe
    the DeltaNet layers)."""
    info = hub.standard_info(arch, {**config, "head_dim": a.head_dim})
    info.update(
        {
            f"{arch}.expert_shared_feed_forward_length": a.shared_expert_intermediate_size,
            f"{arch}.rope.dimension_count": a.rotary_dim,
            f"{arch}.full_attention_interval": _interval(a),
            f"{arch}.ssm.conv_kernel": a.linear_conv_kernel_dim,
            f"{arch}.ssm.state_size": a.linear_key_head_dim,
            f"{arch}.ssm.group_count": a.linear_num_key_heads,
            f"{arch}.ssm.time_step_rank": a.linear_num_value_heads,
            f"{arch}.ssm.inner_size": a.linear_num_value_heads * a.linear_value_head_dim,
        }
    )
    return info


def _interval(a: ModelArgs) -> int:
    """The period of the attention layers (0 where they are not periodic)."""
    full = [i for i in range(a.num_hidden_layers) if not a.is_linear(i)]
    every = full[0] + 1 if full else 0
    periodic = every and full == list(range(every - 1, a.num_hidden_layers, every))
    return every if periodic else 0
