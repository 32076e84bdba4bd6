"""GGUF files written with the `gguf` package from a transformers model (the reference).

Names come from gguf's own tensor-name map, not from FreeToken's, so the converter is
checked against an independent mapping.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

QK_K = 256


def quantize_q4_k(a: np.ndarray) -> np.ndarray:
    """Q4_K blocks (144 bytes per 256 weights) for a float array whose rows are multiples of 256.

    gguf's Python quantizers stop at Q8_0; this follows the Q4_K block format (fp16 d and
    dmin, 6-bit sub-block scales and mins packed into 12 bytes, 4-bit weights) so that
    gguf's own dequantizer can serve as the reference.
    """
    rows = a.reshape(-1, QK_K).astype(np.float32)
    sub = rows.reshape(-1, 8, 32)
    mn = np.minimum(sub.min(axis=2), 0.0)  # [B, 8]
    mx = sub.max(axis=2)
    scale = (mx - mn) / 15.0
    m = -mn
    d = scale.max(axis=1) / 63.0
    dmin = m.max(axis=1) / 63.0
    d16, dmin16 = d.astype(np.float16), dmin.astype(np.float16)
    d, dmin = d16.astype(np.float32), dmin16.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.clip(np.rint(np.where(d[:, None] > 0, scale / d[:, None], 0)), 0, 63).astype(
            np.uint8
        )
        mq = np.clip(np.rint(np.where(dmin[:, None] > 0, m / dmin[:, None], 0)), 0, 63).astype(
            np.uint8
        )
        eff_d = d[:, None] * sc  # [B, 8]
        eff_m = dmin[:, None] * mq
        q = np.where(
            eff_d[:, :, None] > 0, np.rint((sub + eff_m[:, :, None]) / eff_d[:, :, None]), 0
        )
    q = np.clip(q, 0, 15).astype(np.uint8).reshape(-1, QK_K)
    scales = np.zeros((rows.shape[0], 12), np.uint8)
    scales[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = (mq[:, 0:4] & 63) | ((mq[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0xF) | ((mq[:, 4:8] & 0xF) << 4)
    qs = np.zeros((rows.shape[0], 128), np.uint8)
    for c in range(4):
        qs[:, c * 32 : (c + 1) * 32] = q[:, 64 * c : 64 * c + 32] | (
            q[:, 64 * c + 32 : 64 * c + 64] << 4
        )
    blocks = np.concatenate(
        [d16.view(np.uint8).reshape(-1, 2), dmin16.view(np.uint8).reshape(-1, 2), scales, qs],
        axis=1,
    )
    return blocks.reshape(*a.shape[:-1], a.shape[-1] // QK_K * 144)


def _tokenizer_kv(w, tok_dir: Path) -> None:
    tj = json.loads((tok_dir / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    for added in tj["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in tj["added_tokens"] if a.get("special")}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_eos_token_id(vocab[cfg["eos_token"]])
    w.add_chat_template(cfg["chat_template"])


def write_gguf(
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


def _add(w, name: str, arr: np.ndarray, qtype: str) -> None:
    import gguf
    from gguf import GGMLQuantizationType as QT

    if qtype == "F32" or arr.ndim == 1:
        w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
    elif qtype in ("Q8_0", "Q4_0", "BF16"):
        q = gguf.quants.quantize(arr, QT[qtype])
        w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=QT[qtype])
    elif qtype == "F16":
        w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float16))
    elif qtype == "Q4_K":
        q = quantize_q4_k(arr)
        w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=QT.Q4_K)
    else:
        raise ValueError(qtype)


def dequantized_state(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a GGUF file dequantized by gguf itself, by GGUF name."""
    import gguf

    r = gguf.GGUFReader(str(path))
    out = {}
    for t in r.tensors:
        shape = tuple(int(x) for x in reversed(t.shape))
        out[t.name] = torch.from_numpy(
            np.array(gguf.quants.dequantize(t.data, t.tensor_type))
        ).reshape(shape)
    return out
