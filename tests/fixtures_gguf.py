"""GGUF files written with the `gguf` package from a transformers model (the reference).

Names come from gguf's own tensor-name map for the architecture, not from FreeToken's, so
the converter is checked against an independent mapping; the metadata and the tensor
transforms (the llama arch's q/k row permutation, experts stacked per layer) follow
llama.cpp's converter for each architecture.
"""

from __future__ import annotations

import json
from pathlib import Path

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


def _tokenizer_kv(w, tok_dir: Path, pre: str = "gpt-2") -> None:
    """As llama.cpp's converter writes them: CONTROL (3) for special added tokens,
    USER_DEFINED (4) for the other added tokens, add_bos_token from tokenizer_config."""
    tj = json.loads((tok_dir / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    for added in tj["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    kinds = {a["content"]: 3 if a.get("special") else 4 for a in tj["added_tokens"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([kinds.get(t, 1) for t in tokens])
    w.add_add_bos_token(bool(cfg.get("add_bos_token", False)))
    w.add_token_merges(merges)
    w.add_eos_token_id(vocab[cfg["eos_token"]])
    w.add_chat_template(cfg["chat_template"])


def _base_kv(w, c, block_count: int, rms_eps: float) -> None:
    """The keys llama.cpp's converter writes for every decoder (TextModel's parameters)."""
    w.add_block_count(block_count)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    if getattr(c, "intermediate_size", None) is not None:  # all-MoE configs may name none
        w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(rms_eps)
    experts = next(
        getattr(c, k)
        for k in ("num_local_experts", "num_experts", "n_routed_experts")
        if hasattr(c, k)
    )
    w.add_expert_count(experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    if getattr(c, "n_group", None) is not None:
        w.add_expert_group_count(c.n_group)
        w.add_expert_group_used_count(c.topk_group)
    if getattr(c, "head_dim", None):
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)


def _head_dim(c) -> int:
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def _sigmoid_routing_kv(w, c) -> None:
    """The grouped sigmoid routers' keys (dots1, glm4moe)."""
    import gguf

    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_leading_dense_block_count(c.first_k_dense_replace)
    w.add_expert_shared_count(c.n_shared_experts)
    w.add_expert_weights_scale(c.routed_scaling_factor)
    w.add_expert_weights_norm(c.norm_topk_prob)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)


def _minimax_kv(w, c) -> None:
    import gguf

    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_feed_forward_length(c.intermediate_size)
    w.add_rope_dimension_count(int(_head_dim(c) * c.rope_parameters["partial_rotary_factor"]))


def _gpt_oss_kv(w, c) -> None:
    import gguf

    w.add_sliding_window(c.sliding_window)
    w.add_expert_feed_forward_length(c.intermediate_size)
    rope = c.rope_parameters
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])


def _ernie_kv(w, c) -> None:
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_expert_shared_count(c.moe_num_shared_experts)
    w.add_leading_dense_block_count(c.moe_layer_start_index)
    w.add_interleave_moe_layer_step(c.moe_layer_interval)
    # what llama.cpp's converter writes here (unused by its model)
    w.add_expert_shared_feed_forward_length(c.intermediate_size // c.num_key_value_heads)


def _granite_kv(w, c) -> None:
    w.add_attention_scale(c.attention_multiplier)
    w.add_embedding_scale(c.embedding_multiplier)
    w.add_residual_scale(c.residual_multiplier)
    w.add_logit_scale(c.logits_scaling)


def _hybrid_kv(w, c) -> None:
    """Qwen3-Next and Qwen3.5-MoE: the DeltaNet layers' keys."""
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    w.add_ssm_conv_kernel(c.linear_conv_kernel_dim)
    w.add_ssm_state_size(c.linear_key_head_dim)
    w.add_ssm_group_count(c.linear_num_key_heads)
    w.add_ssm_time_step_rank(c.linear_num_value_heads)
    w.add_ssm_inner_size(c.linear_value_head_dim * c.linear_num_value_heads)
    # the Hub config's full_attention_interval (transformers keeps only layer_types)
    w.add_full_attention_interval(c.layer_types.index("full_attention") + 1)
    factor = c.rope_parameters.get("partial_rotary_factor", 0.25)
    w.add_rope_dimension_count(int(_head_dim(c) * factor))


def _glm4moe_kv(w, c) -> None:
    w.add_rope_dimension_count(int(_head_dim(c) * c.rope_parameters["partial_rotary_factor"]))
    _sigmoid_routing_kv(w, c)


def _qwen2moe_kv(w, c) -> None:
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)


def _llama_kv(w, c) -> None:
    w.add_vocab_size(c.vocab_size)
    w.add_rope_dimension_count(_head_dim(c))


def _qwen3moe_kv(w, c) -> None:
    w.add_expert_feed_forward_length(c.moe_intermediate_size)


# the keys each architecture's converter class adds
_ARCH_KV = {
    "qwen3moe": _qwen3moe_kv,
    "qwen3vlmoe": _qwen3moe_kv,
    "qwen2moe": _qwen2moe_kv,
    "llama": _llama_kv,
    "minimax-m2": _minimax_kv,
    "gpt-oss": _gpt_oss_kv,
    "ernie4_5-moe": _ernie_kv,
    "dots1": _sigmoid_routing_kv,
    "granitemoe": _granite_kv,
    "qwen3next": _hybrid_kv,
    "qwen35moe": _hybrid_kv,
    "glm4moe": _glm4moe_kv,
}


def _arch_kv(w, c, arch: str) -> None:
    if arch in _ARCH_KV:
        _ARCH_KV[arch](w, c)


def permute_for_ggml_rope(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves each head's two halves of q/k rows for llama-arch
    files (GGML's rope rotates adjacent pairs)."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _tensors(model, arch: str, block_count: int, legacy: bool = False):
    """(GGUF name, array) of every tensor, named by gguf's own map for the arch; `legacy`:
    as older converters wrote it (qwen3next: q/k/v/z kept in one tensor)."""
    import gguf

    c = model.config.get_text_config()  # a multimodal model's language model
    arch_enum = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch]
    name_map = gguf.get_tensor_name_map(arch_enum, block_count)

    def gguf_name(hf: str) -> str:
        found = name_map.get_name(hf, try_suffixes=(".weight", ".bias"))
        if found is None:
            raise KeyError(f"gguf's {arch} name map has no tensor for {hf}")
        return found

    for name, t in model.state_dict().items():
        if arch == "qwen3vlmoe":  # the language model alone, named as a text model's
            if name.startswith("model.visual."):
                continue
            name = name.replace("model.language_model.", "model.")
        arr = t.detach().float().numpy()
        if arch == "gpt-oss" and ".experts." in name:
            yield from _gpt_oss_experts(name, arr, gguf_name)
            continue
        if arch in ("qwen3next", "qwen35moe"):
            if arch == "qwen35moe" and ".linear_attn." in name:
                arr = _tiled_value_heads(name, arr, c)
            name, arr = _qwen3next_values(name, arr)
            if name.endswith("in_proj_qkvz.weight") and not legacy:
                yield from _qwen3next_qkvz(name, arr, c, gguf_name)
                continue
            if name.endswith("in_proj_ba.weight") and arch == "qwen35moe":  # Ollama's name
                yield f"blk.{name.split('.')[2]}.ssm_ba.weight", arr
                continue
        if name.endswith(".sinks"):  # llama.cpp's converter names them as a weight
            name += ".weight"
        name = _as_llama_cpp_reads(name)
        if arch in ("llama", "granitemoe") and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = c.num_attention_heads if "q_proj" in name else c.num_key_value_heads
            arr = permute_for_ggml_rope(arr, heads)
        if arch == "granitemoe" and ".experts." in name:  # its converter names them itself
            yield from _granite_experts(name, arr)
            continue
        if name.endswith("experts.gate_up_proj"):
            base = name.removesuffix(".gate_up_proj")
            gate, up = np.split(arr, 2, axis=1)
            yield gguf_name(f"{base}.gate_proj") + ".weight", gate
            yield gguf_name(f"{base}.up_proj") + ".weight", up
        elif name.endswith("experts.down_proj"):
            yield gguf_name(name) + ".weight", arr
        else:
            yield gguf_name(name), arr


def _qwen3next_values(name: str, arr: np.ndarray) -> tuple[str, np.ndarray]:
    """What llama.cpp's Qwen3-Next converter does to values and names: −e^{A_log} for A_log,
    dt_bias named as dt_proj's bias, the conv kernel's middle axis dropped, and one added to
    every norm's weight but the DeltaNet's gated norm (zero-centred norms made plain)."""
    if name.endswith(".A_log"):
        return name, -np.exp(arr)
    if name.endswith(".dt_bias"):
        return name.replace(".dt_bias", ".dt_proj.bias"), arr
    if "conv1d" in name:
        return name, arr.squeeze(1)
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        return name, arr + 1
    return name, arr


def _tiled_value_heads(name: str, arr: np.ndarray, c) -> np.ndarray:
    """Qwen3.5's value heads as its converters order them where they outnumber the key
    heads: the one serving key head g as its j-th moves from g·r + j to j·HK + g, along the
    rows of q/k/v (v's part), z, b, a, A_log, dt_bias and the conv kernel (v's channels), and
    the output projection's columns. (A Qwen3-Next model's, as Ollama writes it, stay.)"""
    hk, hv = c.linear_num_key_heads, c.linear_num_value_heads
    if hk == hv or c.model_type == "qwen3_next":
        return arr
    r, dv, qk = hv // hk, c.linear_value_head_dim, 2 * hk * c.linear_key_head_dim

    def tile(x: np.ndarray, axis: int, width: int) -> np.ndarray:
        shape = x.shape
        grouped = x.reshape(*shape[:axis], hk, r, width, *shape[axis + 1 :])
        return np.swapaxes(grouped, axis, axis + 1).reshape(shape)

    part = name.split(".linear_attn.")[1]
    if part in ("in_proj_qkv.weight", "conv1d.weight"):
        return np.concatenate([arr[:qk], tile(arr[qk:], 0, dv)])
    if part == "in_proj_z.weight":
        return tile(arr, 0, dv)
    if part in ("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias"):
        return tile(arr, 0, 1)
    if part == "out_proj.weight":
        return tile(arr, 1, dv)
    return arr


def _qwen3next_qkvz(name: str, arr: np.ndarray, c, gguf_name):
    """in_proj_qkvz (rows grouped by key head: q, k, then its value heads' v and z) split as
    llama.cpp's converter splits it: every q, every k, every v (attn_qkv), and z (attn_gate)."""
    r = c.linear_num_value_heads // c.linear_num_key_heads
    dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
    grouped = arr.reshape(c.linear_num_key_heads, 2 * dk + 2 * r * dv, arr.shape[-1])
    q, k, v, z = np.split(grouped, np.cumsum([dk, dk, r * dv]), axis=1)
    flat = [x.reshape(-1, arr.shape[-1]) for x in (q, k, v, z)]
    base = name.removesuffix(".in_proj_qkvz.weight")
    yield gguf_name(f"{base}.in_proj_qkv.weight"), np.concatenate(flat[:3])
    yield gguf_name(f"{base}.in_proj_z.weight"), flat[3]


def _granite_experts(name: str, arr: np.ndarray):
    """Granite's input_linear split into gate and up banks, output_linear the down bank."""
    import gguf

    layer = int(name.split(".")[2])
    names = gguf.TENSOR_NAMES
    t = gguf.MODEL_TENSOR
    if name.endswith("gate_up_proj"):
        gate, up = np.split(arr, 2, axis=1)
        yield names[t.FFN_GATE_EXP].format(bid=layer) + ".weight", gate
        yield names[t.FFN_UP_EXP].format(bid=layer) + ".weight", up
    else:
        yield names[t.FFN_DOWN_EXP].format(bid=layer) + ".weight", arr


def _as_llama_cpp_reads(name: str) -> str:
    """A transformers state-dict name as llama.cpp's converter looks it up."""
    name = name.replace(".block_sparse_moe.router.weight", ".block_sparse_moe.router.layer.weight")
    name = name.replace("e_score_correction_bias", "e_score_correction.bias")
    # ERNIE's Hub checkpoints (what llama.cpp reads) keep the bias beside the router
    return name.replace(".mlp.gate.moe_statics.", ".mlp.moe_statics.")


def _gpt_oss_experts(name: str, arr: np.ndarray, gguf_name):
    """gpt-oss's whole-layer banks as llama.cpp's converter writes them: matrices transposed
    to [E, out, in], the interleaved gate/up columns (and bias entries) split in two."""
    base, part = name.rsplit(".", 1)
    if part.startswith("gate_up_proj"):
        bias = part.endswith("_bias")
        if not bias:
            arr = arr.swapaxes(-1, -2)  # [E, 2I, H]
        gate, up = (arr[..., 0::2], arr[..., 1::2]) if bias else (arr[:, 0::2], arr[:, 1::2])
        suffix = ".bias" if bias else ".weight"
        yield gguf_name(f"{base}.gate_proj") + suffix, np.ascontiguousarray(gate)
        yield gguf_name(f"{base}.up_proj") + suffix, np.ascontiguousarray(up)
    elif part == "down_proj_bias":
        yield gguf_name(f"{base}.down_proj") + ".bias", arr
    else:
        yield gguf_name(f"{base}.down_proj") + ".weight", np.ascontiguousarray(arr.swapaxes(-1, -2))


def write_gguf(
    model,
    tok_dir: Path,
    out: Path,
    qtype: str = "F32",
    arch: str = "qwen3moe",
    nextn: int = 0,
    extra: dict[str, np.ndarray] | None = None,
    pre: str = "gpt-2",
    file_type: int | None = None,
    legacy: bool = False,
    split_max_tensors: int = 0,
) -> Path:
    """The model's weights as a GGUF of llama.cpp's architecture `arch`, with the metadata
    and tensor names its converter writes (names from gguf's own map); expert (and large)
    tensors in `qtype`. nextn: the model's last layers are multi-token-prediction layers
    (counted in block_count, as llama.cpp's GLM-4.5 converter counts them); `extra` adds
    tensors by GGUF name; `file_type` is general.file_type (llama.cpp's LlamaFileType);
    `legacy`: the layout older converters of `arch` wrote; `split_max_tensors`: split in
    parts of that many tensors, as gguf's writer (llama.cpp's gguf-split) names them (the
    first part's path is returned)."""
    import gguf

    c = model.config.get_text_config()  # a multimodal model's language model
    w = gguf.GGUFWriter(str(out), arch, split_max_tensors=split_max_tensors)
    # llama.cpp's OLMoE converter writes a fixed epsilon
    _base_kv(w, c, c.num_hidden_layers, 1e-5 if arch == "olmoe" else c.rms_norm_eps)
    _arch_kv(w, c, arch)
    if nextn:
        w.add_nextn_predict_layers(nextn)
    if file_type is not None:
        w.add_file_type(file_type)
    _tokenizer_kv(w, tok_dir, pre)
    tensors = _tensors(model, arch, c.num_hidden_layers, legacy)
    for name, arr in [*tensors, *(extra or {}).items()]:
        quantize = arr.ndim == 3 or (arr.ndim == 2 and arr.shape[-1] % 256 == 0)  # experts, big
        _add(w, name, arr, _type_of(qtype, name, c.num_hidden_layers) if quantize else "F32")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    parts = sorted(out.parent.glob(f"{out.stem}-*-of-*.gguf"))
    return parts[0] if split_max_tensors and parts else out


def _type_of(qtype: str, name: str, layers: int) -> str:
    """A tensor's type in a file of `qtype`: Q4_K_M mixes Q4_K with Q6_K as llama.cpp does (the
    output head, and expert down projections in the first and last eighth of the layers and
    every third between), so a file's down banks differ from layer to layer."""
    if qtype != "Q4_K_M":
        return qtype
    if name == "output.weight":
        return "Q6_K"
    if "ffn_down" in name:
        i = int(name.split(".")[1])
        more = i < layers // 8 or i >= 7 * layers // 8 or (i - layers // 8) % 3 == 2
        return "Q6_K" if more else "Q4_K"
    return "Q4_K"


def _add(w, name: str, arr: np.ndarray, qtype: str) -> None:
    import gguf
    from gguf import GGMLQuantizationType as QT

    if qtype == "F32" or arr.ndim == 1:
        w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
    elif qtype in ("Q8_0", "Q4_0", "Q5_0", "BF16", "MXFP4"):
        q = gguf.quants.quantize(arr, QT[qtype])
        w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=QT[qtype])
    elif qtype == "F16":
        w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float16))
    elif qtype == "Q4_K":
        q = quantize_q4_k(arr)
        w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=QT.Q4_K)
    elif qtype in ("Q5_K", "Q6_K"):  # gguf has no quantizer for these; its dequantizer checks ours
        from freetoken.quant.quantize import quantize

        q = quantize(torch.from_numpy(np.ascontiguousarray(arr)), qtype.lower()).numpy()
        w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=QT[qtype])
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


def dequantized_model(model, path: Path, arch: str):
    """A copy of the transformers `model` computing with a GGUF file's weights as gguf decodes
    them (for the architectures whose converters only rename and split: no q/k permutation):
    the exact reference for a quantized file."""
    import copy

    import gguf

    assert arch in ("qwen3moe", "olmoe", "qwen2moe", "ernie4_5-moe"), arch
    arch_enum = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch]
    names = gguf.get_tensor_name_map(arch_enum, model.config.num_hidden_layers)
    state = dequantized_state(path)

    def of(hf: str) -> torch.Tensor:
        return state[names.get_name(hf, try_suffixes=(".weight", ".bias"))]

    def experts(hf: str) -> torch.Tensor:  # whole-layer tensors: the map names them bare
        return state[names.get_name(hf) + ".weight"]

    ref = copy.deepcopy(model)
    with torch.no_grad():
        for name, t in ref.state_dict().items():
            if name.endswith("experts.gate_up_proj"):
                base = name.removesuffix(".gate_up_proj")
                gate, up = (experts(f"{base}.{p}_proj") for p in ("gate", "up"))
                t.copy_(torch.cat([gate, up], dim=1))
            elif name.endswith("experts.down_proj"):
                t.copy_(experts(name))
            else:
                t.copy_(of(_as_llama_cpp_reads(name)).reshape(t.shape))
    return ref
