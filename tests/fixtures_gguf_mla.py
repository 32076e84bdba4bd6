"""GGUF files of the multi-head latent attention families (deepseek_v3, deepseek_v2,
glm4_moe_lite; llama.cpp's deepseek2 architecture), written with the `gguf` package from a
transformers model; names from gguf's own map, as in fixtures_gguf.py."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tests.fixtures_gguf import _add, _tokenizer_kv


def write_mla_gguf(
    model, tok_dir: Path, out: Path, qtype: str = "F32", arch: str | None = None, **options
) -> Path:
    """The model's weights as a GGUF of its family's llama.cpp architecture (or `arch`, for
    a file that names another with the same tensors); expert (and large) tensors in `qtype`.

    Families: qwen3_moe (qwen3moe) and the multi-head latent attention ones, deepseek_v3,
    deepseek_v2 and glm4_moe_lite (deepseek2). For those, `split_kv_b=False` writes
    kv_b_proj whole (attn_kv_b, llama.cpp's older files) instead of split per head."""
    import gguf

    c = model.config
    family = _families()[c.model_type]
    w = gguf.GGUFWriter(str(out), arch or family.arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_expert_count(c.num_local_experts if hasattr(c, "num_local_experts") else c.num_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    family.metadata(w, c, **options)
    _tokenizer_kv(w, tok_dir)
    name_map = gguf.get_tensor_name_map(family.name_map, c.num_hidden_layers)
    for name, t in model.state_dict().items():
        for gname, arr in family.tensors(name, t.detach().float().numpy(), c, **options):
            if gname is None:
                gname = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
            big = arr.ndim == 2 and arr.shape[-1] % 256 == 0
            _add(w, gname, arr, qtype if big or "_exps" in gname else "F32")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _experts(name: str, arr: np.ndarray):
    """transformers' fused banks as llama.cpp's ffn_{gate,up,down}_exps, else nothing."""
    if name.endswith("mlp.experts.gate_up_proj"):
        layer = name.split(".")[2]
        gate, up = np.split(arr, 2, axis=1)
        return [
            (f"blk.{layer}.ffn_gate_exps.weight", gate),
            (f"blk.{layer}.ffn_up_exps.weight", up),
        ]
    if name.endswith("mlp.experts.down_proj"):
        return [(f"blk.{name.split('.')[2]}.ffn_down_exps.weight", arr)]
    return []


def _qwen3moe_metadata(w, c) -> None:
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)


def _qwen3moe_tensors(name: str, arr: np.ndarray, c):
    return _experts(name, arr) or [(None, arr)]


def _deepseek2_metadata(w, c, split_kv_b: bool = True) -> None:
    """What llama.cpp's converter writes for DeepSeek-V2/V3 (and GLM-4.7-Flash)."""
    import gguf

    r, dr, dn, dv = c.kv_lora_rank, c.qk_rope_head_dim, c.qk_nope_head_dim, c.v_head_dim
    if split_kv_b:  # one latent "head": keys r + dr, values r; the real sizes beside them
        w.add_head_count_kv(1)
        w.add_key_length(r + dr)
        w.add_value_length(r)
        w.add_key_length_mla(dn + dr)
        w.add_value_length_mla(dv)
    else:
        w.add_head_count_kv(c.num_attention_heads)
        w.add_key_length(dn + dr)
        w.add_value_length(dv)
    if c.q_lora_rank:
        w.add_q_lora_rank(c.q_lora_rank)
    w.add_kv_lora_rank(r)
    w.add_rope_dimension_count(dr)
    dense = getattr(c, "first_k_dense_replace", None)
    if dense is None:  # GLM-4.7-Flash: mlp_layer_types, dense layers leading
        dense = c.mlp_layer_types.index("sparse")
    w.add_leading_dense_block_count(dense)
    w.add_expert_shared_count(c.n_shared_experts)
    w.add_expert_weights_scale(c.routed_scaling_factor)
    softmax = c.model_type == "deepseek_v2"
    w.add_expert_weights_norm(bool(c.norm_topk_prob) and not softmax)
    w.add_expert_gating_func(
        gguf.ExpertGatingFuncType.SOFTMAX if softmax else gguf.ExpertGatingFuncType.SIGMOID
    )
    grouped = not softmax or c.topk_method == "group_limited_greedy"
    w.add_expert_group_count((c.n_group or 1) if grouped else 1)
    w.add_expert_group_used_count((c.topk_group or 1) if grouped else 1)
    rope = c.rope_parameters
    if rope["rope_type"] == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def _deepseek2_tensors(name: str, arr: np.ndarray, c, split_kv_b: bool = True):
    if found := _experts(name, arr):
        return found
    if name.endswith("e_score_correction_bias"):
        return [(f"blk.{name.split('.')[2]}.exp_probs_b.bias", arr)]
    if split_kv_b and name.endswith("self_attn.kv_b_proj.weight"):
        # as llama.cpp's converter: per head, k_b transposed [H, r, dn], v_b [H, dv, r]
        blk = f"blk.{name.split('.')[2]}"
        per_head = arr.reshape(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, -1)
        k_b, v_b = per_head[:, : c.qk_nope_head_dim], per_head[:, c.qk_nope_head_dim :]
        return [
            (f"{blk}.attn_k_b.weight", np.ascontiguousarray(k_b.transpose(0, 2, 1))),
            (f"{blk}.attn_v_b.weight", np.ascontiguousarray(v_b)),
        ]
    return [(None, arr)]


@dataclass(frozen=True)
class _Family:
    arch: str
    name_map: Any  # gguf.MODEL_ARCH
    metadata: Callable
    tensors: Callable


def _families() -> dict[str, _Family]:
    import gguf

    A = gguf.MODEL_ARCH
    mla = _Family("deepseek2", A.DEEPSEEK2, _deepseek2_metadata, _deepseek2_tensors)
    return {
        "qwen3_moe": _Family("qwen3moe", A.QWEN3MOE, _qwen3moe_metadata, _qwen3moe_tensors),
        "deepseek_v3": mla,
        "deepseek_v2": mla,
        "glm4_moe_lite": mla,
    }
