"""The GGUF side of the multi-head latent attention families (llama.cpp's `deepseek2`
architecture, which DeepSeek-V2/V3 and GLM-4.7-Flash files use, and Ollama's
`glm4moelite`): tensor names, the config the metadata implies, and the metadata `show`
prints for a model of the family.

llama.cpp writes kv_b_proj in one of two layouts: whole (`attn_kv_b`, older files) or, since
it absorbs it at decode, split per head (`attn_k_b` [H, r, dn], `attn_v_b` [H, dv, r]); the
split files also say the attention's real head sizes under `key_length_mla` /
`value_length_mla` (their `key_length` / `value_length` being the latent's), which is how
the config tells the two apart.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from freetoken.models import hub
from freetoken.models.base import ExpertKey

__all__ = ["config_from_gguf", "gguf_key", "model_info"]

GGUF_DENSE = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "attn_k_b": "self_attn.k_b_proj",
    "attn_v_b": "self_attn.v_b_proj",
    "attn_output": "self_attn.o_proj",
    "attn_out": "self_attn.o_proj",  # Ollama's spelling
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
GGUF_EXPERTS = {
    "ffn_gate_exps": ("gate_up", 0),
    "ffn_up_exps": ("gate_up", 1),
    "ffn_down_exps": ("down", None),
}
CORRECTION_BIAS = "exp_probs_b"  # the router's e_score_correction_bias
GATING_SOFTMAX, GATING_SIGMOID = 1, 2  # llama.cpp's expert_gating_func
V2_MODEL_TYPE = "deepseek_v2"


def gguf_key(name: str) -> str | ExpertKey:
    """The model's name for a GGUF tensor, or the bank it belongs to."""
    parts = name.split(".")
    if parts[0] != "blk":
        return f"{GGUF_DENSE[parts[0]]}.{parts[-1]}"
    layer, kind = int(parts[1]), parts[2]
    if kind in GGUF_EXPERTS:
        bank, half = GGUF_EXPERTS[kind]
        return ExpertKey(layer, bank, expert=None, half=half)
    if kind == CORRECTION_BIAS:  # blk.N.exp_probs_b.bias (or .weight, or bare)
        return f"model.layers.{layer}.mlp.gate.e_score_correction_bias"
    return f"model.layers.{layer}.{GGUF_DENSE[kind]}.{parts[-1]}"


def _rope_scaling(g) -> dict[str, Any] | None:
    if g("rope.scaling.type") != "yarn":
        return None
    # llama.cpp keeps 0.1 · mscale_all_dim, and cancels YaRN's own attention factor (mscale)
    mscale = round(float(g("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1, 6)
    scaling = {
        "type": "yarn",
        "factor": float(g("rope.scaling.factor")),
        "original_max_position_embeddings": int(g("rope.scaling.original_context_length")),
        "mscale": mscale,
        "mscale_all_dim": mscale,
    }
    for key in ("beta_fast", "beta_slow"):
        if g(f"rope.scaling.yarn_{key}") is not None:
            scaling[key] = float(g(f"rope.scaling.yarn_{key}"))
    return scaling


def config_from_gguf(
    kv: Mapping[str, Any], arch: str, model_type: str, gating: int = GATING_SOFTMAX
) -> dict[str, Any]:
    """A Hub-style config.json from GGUF metadata: `model_type` is the family a sigmoid-gated
    file is, a softmax-gated one DeepSeek-V2's; `gating` is what a file naming none has."""

    def g(key: str, default: Any = None) -> Any:
        return kv.get(f"{arch}.{key}", default)

    heads = int(g("attention.head_count"))
    rope_dim = int(g("rope.dimension_count"))
    split = g("attention.key_length_mla") is not None
    key_length = int(g("attention.key_length_mla" if split else "attention.key_length"))
    value_length = int(g("attention.value_length_mla" if split else "attention.value_length"))
    softmax = int(g("expert_gating_func", gating)) == GATING_SOFTMAX
    n_group = int(g("expert_group_count", 1) or 1)
    config = {
        "model_type": V2_MODEL_TYPE if softmax else model_type,
        "hidden_size": int(g("embedding_length")),
        "num_hidden_layers": int(g("block_count")),
        "intermediate_size": int(g("feed_forward_length", 0)),
        "moe_intermediate_size": int(g("expert_feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "q_lora_rank": int(g("attention.q_lora_rank", 0)) or None,
        "kv_lora_rank": int(g("attention.kv_lora_rank")),
        "qk_rope_head_dim": rope_dim,
        "qk_nope_head_dim": key_length - rope_dim,
        "v_head_dim": value_length,
        "n_routed_experts": int(g("expert_count")),
        "num_experts_per_tok": int(g("expert_used_count")),
        "n_shared_experts": int(g("expert_shared_count", 0)),
        "first_k_dense_replace": int(g("leading_dense_block_count", 0)),
        "routed_scaling_factor": float(g("expert_weights_scale", 1.0) or 1.0),
        "norm_topk_prob": bool(g("expert_weights_norm", False)),
        "n_group": n_group,
        "topk_group": int(g("expert_group_used_count", 1) or 1),
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(g("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(g),
        "rope_interleave": True,  # llama.cpp rotates deepseek2's adjacent pairs
        "max_position_embeddings": int(g("context_length", 4096)),
        "split_kv_b": split,
    }
    if softmax:
        config["topk_method"] = "group_limited_greedy" if n_group > 1 else "greedy"
    return config


def model_info(arch: str, a: Any, config: Mapping[str, Any], gating: int) -> dict[str, Any]:
    """The keys llama.cpp writes for the architecture (the split kv_b layout's), from a
    model's parsed args `a` and its routing's gating."""
    info = hub.standard_info(arch, config)
    latent = a.kv_lora_rank + a.qk_rope_head_dim
    info |= {
        f"{arch}.feed_forward_length": a.intermediate_size,
        f"{arch}.attention.head_count_kv": 1,
        f"{arch}.attention.key_length": latent,
        f"{arch}.attention.value_length": a.kv_lora_rank,
        f"{arch}.attention.key_length_mla": a.qk_nope_head_dim + a.qk_rope_head_dim,
        f"{arch}.attention.value_length_mla": a.v_head_dim,
        f"{arch}.attention.kv_lora_rank": a.kv_lora_rank,
        f"{arch}.attention.q_lora_rank": a.q_lora_rank or 0,
        f"{arch}.rope.dimension_count": a.qk_rope_head_dim,
        f"{arch}.leading_dense_block_count": len(a.dense_layers),
        f"{arch}.expert_shared_count": a.n_shared_experts,
        f"{arch}.expert_weights_scale": a.routed_scaling_factor,
        f"{arch}.expert_weights_norm": a.norm_topk_prob and gating == GATING_SIGMOID,
        f"{arch}.expert_gating_func": gating,
        f"{arch}.expert_group_count": a.n_group,
        f"{arch}.expert_group_used_count": a.topk_group,
    }
    if a.rope_scaling.kind == "yarn":
        s = a.rope_scaling
        info |= {
            f"{arch}.rope.scaling.type": "yarn",
            f"{arch}.rope.scaling.factor": s.factor,
            f"{arch}.rope.scaling.original_context_length": s.original_max_position_embeddings,
            f"{arch}.rope.scaling.yarn_log_multiplier": 0.1 * s.mscale_all_dim,
        }
    return info
