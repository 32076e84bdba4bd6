"""gpt-oss (gpt-oss-20b, gpt-oss-120b): GQA with q/k/v/o biases and a learned sink logit per
head, sliding-window and full attention layers as `layer_types` says (alternating, the
first sliding, by default), YaRN rope, and routed experts in every layer: a router with a
bias keeps each token's top-k logits and softmaxes over those alone (the same weights as a
softmax over all, renormalised over the k), and every expert carries biases and computes
the clamped SwiGLU (models/base.py, ACTIVATIONS).

Checkpoints store each layer's experts whole, as transformers holds them:
`mlp.experts.gate_up_proj` [E, H, 2I] with gate and up columns interleaved, its bias
[E, 2I] interleaved alike, `mlp.experts.down_proj` [E, I, H] and its bias [E, H]; the
router is `mlp.router`. llama.cpp's gpt-oss GGUF files split gate and up instead
(ffn_gate_exps / ffn_up_exps, each with a .bias).

Shapes: T = tokens in the step, H = hidden, E = experts, I = expert width.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from freetoken.layers.moe import Experts, SparseMoeBlock, TopKRouter
from freetoken.layers.rope_scaling import RopeScaling, ScaledRotaryEmbedding
from freetoken.models import common, hub
from freetoken.models.base import ExpertKey, ExpertSpec
from freetoken.models.decoder import DecoderLayer, DecoderModel, DecoderStack, attention

GGUF_ARCH = "gpt-oss"
SLIDING, FULL = "sliding_attention", "full_attention"
# what transformers assumes where a config names no rope settings (the released models')
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


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
    layer_types: tuple[str, ...]
    sliding_window: int = 128
    attention_bias: bool = True
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    rms_norm_eps: float = 1e-5
    rope_theta: float = 150000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 131072

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> ModelArgs:
        layers = int(cfg["num_hidden_layers"])
        types = tuple(cfg.get("layer_types") or (SLIDING, FULL) * (layers // 2 + 1))[:layers]
        unknown = set(types) - {SLIDING, FULL}
        if unknown:
            raise ValueError(f"unknown gpt-oss layer types {sorted(unknown)}")
        params = hub.rope_parameters(cfg)
        if not (cfg.get("rope_scaling") or (cfg.get("rope_parameters") or {}).get("rope_type")):
            params |= DEFAULT_ROPE
        max_pos = int(cfg.get("max_position_embeddings") or 131072)
        return common.args_from(
            cls,
            cfg,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
            num_local_experts=hub.num_experts(cfg),
            layer_types=types,
            rope_theta=hub.rope_theta(cfg, 150000.0),
            rope_scaling=RopeScaling.from_params(params, max_pos),
        )

    @property
    def expert_spec(self) -> ExpertSpec:
        return ExpertSpec(
            self.hidden_size,
            self.intermediate_size,
            activation="swiglu_clamped",
            alpha=self.swiglu_alpha,
            limit=self.swiglu_limit,
            bias=True,
        )


def _layer(a: ModelArgs, i: int) -> DecoderLayer:
    attn = attention(
        a,
        i,
        bias=a.attention_bias,
        window=a.sliding_window if a.layer_types[i] == SLIDING else 0,
        sinks=True,
    )
    # top-k of the logits then a softmax over them is a softmax over every expert,
    # renormalised over the top k: TopKRouter's renormalising form
    router = TopKRouter(a.hidden_size, a.num_local_experts, a.num_experts_per_tok, True, bias=True)
    mlp = SparseMoeBlock(router, Experts(i, a.num_local_experts, a.expert_spec))
    return DecoderLayer(attn, mlp, a.hidden_size, a.rms_norm_eps)


# the checkpoint's whole-layer expert tensors, and where each lands among the banks
_BANKS = {
    "gate_up_proj": ("gate_up", True, True),  # (bank, transposed, interleaved)
    "gate_up_proj_bias": ("gate_up_bias", False, True),
    "down_proj": ("down", True, False),
    "down_proj_bias": ("down_bias", False, False),
    # MXFP4 checkpoints: each matrix as blocks of codes [E, out, in/32, 16] (not transposed;
    # gate and up rows still interleaved), whose scales the weight reader packs in
    "gate_up_proj_blocks": ("gate_up", False, True),
    "down_proj_blocks": ("down", False, False),
}
_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\w+)")


class Model(DecoderModel):
    Args = ModelArgs

    def __init__(self, args: ModelArgs):
        rotary = ScaledRotaryEmbedding(args.head_dim, args.rope_theta, args.rope_scaling)
        super().__init__(args, DecoderStack.of(args, _layer, rotary))

    dense_key = staticmethod(common.renamer((r"\.mlp\.router\.", ".mlp.gate.")))

    @staticmethod
    def expert_key(name: str) -> ExpertKey | None:
        m = _EXPERTS.fullmatch(name)
        if not m:
            return None
        bank, transposed, interleaved = _BANKS[m.group(2)]
        return ExpertKey(int(m.group(1)), bank, transposed=transposed, interleaved=interleaved)

    @classmethod
    def model_info(cls, config: Mapping[str, Any]) -> dict[str, Any]:
        a = ModelArgs.from_dict(config)
        info = hub.standard_info(GGUF_ARCH, config)
        p = f"{GGUF_ARCH}."
        info |= {
            p + "expert_feed_forward_length": a.intermediate_size,
            p + "attention.value_length": a.head_dim,
            p + "attention.sliding_window": a.sliding_window,
            p + "rope.freq_base": a.rope_theta,
        }
        s = a.rope_scaling
        if s.kind == "yarn":
            info |= {
                p + "rope.scaling.type": "yarn",
                p + "rope.scaling.factor": s.factor,
                p + "rope.scaling.original_context_length": s.original_max_position_embeddings,
            }
        return info

    @staticmethod
    def config_from_gguf(kv: Mapping[str, Any], arch: str) -> dict[str, Any]:
        """A Hub-style config.json from llama.cpp's gpt-oss metadata. Its files name no
        layer pattern (llama.cpp alternates, the first layer sliding, as transformers does)
        nor the clamp (llama.cpp's is the released models': alpha 1.702, limit 7)."""

        def g(key: str, default: Any = None) -> Any:
            return kv.get(f"{arch}.{key}", default)

        base = common.gguf_base_config(kv, arch)
        rope: dict[str, Any] = {"rope_type": "default"}
        if g("rope.scaling.type") == "yarn":
            # the ramp is not rounded outwards (truncate off), as the model was trained;
            # llama.cpp rounds it, a small departure this model does not copy
            rope = {
                "rope_type": "yarn",
                "factor": float(g("rope.scaling.factor")),
                "original_max_position_embeddings": int(g("rope.scaling.original_context_length")),
                "beta_fast": float(g("rope.scaling.yarn_beta_fast", 32.0)),
                "beta_slow": float(g("rope.scaling.yarn_beta_slow", 1.0)),
                "truncate": False,
            }
        return {
            **base,
            "architectures": ["GptOssForCausalLM"],
            "model_type": "gpt_oss",
            "num_local_experts": int(g("expert_count")),
            "intermediate_size": int(g("expert_feed_forward_length")),
            "sliding_window": int(g("attention.sliding_window", 128)),
            "rope_scaling": rope,
        }
