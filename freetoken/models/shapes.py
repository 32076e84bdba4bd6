"""Named shapes of real models, as Hub-style configs, for benchmarks' random-weight models.

Each is what the model's own config.json says (depth may be cut, and is then named so);
the weights a benchmark builds from it are random. Presets of several families live here,
beside the model files, so the benchmarks name none.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SHAPES"]

QWEN3_30B_A3B: dict[str, Any] = dict(
    model_type="qwen3_moe",
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    max_position_embeddings=40960,
    tie_word_embeddings=False,
)

# GLM-4.5-Air as its config.json states it: 46 layers, the first dense, 128 routed experts
# (top-8) and one shared, partial rotary. Its 45 MoE layers hold 200 GB of experts in BF16.
GLM_4_5_AIR: dict[str, Any] = dict(
    model_type="glm4_moe",
    vocab_size=151552,
    hidden_size=4096,
    intermediate_size=10944,
    moe_intermediate_size=1408,
    num_hidden_layers=46,
    num_attention_heads=96,
    num_key_value_heads=8,
    head_dim=128,
    partial_rotary_factor=0.5,
    n_routed_experts=128,
    num_experts_per_tok=8,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=1.0,
    norm_topk_prob=True,
    attention_bias=True,
    use_qk_norm=False,
    rms_norm_eps=1e-5,
    rope_theta=1000000.0,
    max_position_embeddings=131072,
    tie_word_embeddings=False,
)

# gpt-oss-120b as its config.json states it: 36 layers alternating a 128-token sliding window
# and full attention, 128 experts (top-4) of width 2880 with biases and the clamped SwiGLU,
# YaRN. Its experts are 229 GB in BF16 (the released checkpoint is MXFP4).
GPT_OSS_120B: dict[str, Any] = dict(
    model_type="gpt_oss",
    vocab_size=201088,
    hidden_size=2880,
    intermediate_size=2880,
    num_hidden_layers=36,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=64,
    num_local_experts=128,
    num_experts_per_tok=4,
    sliding_window=128,
    attention_bias=True,
    swiglu_limit=7.0,
    rms_norm_eps=1e-5,
    rope_theta=150000.0,
    rope_scaling={
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
    max_position_embeddings=131072,
    tie_word_embeddings=False,
)

# Qwen3-Next-80B-A3B as its config.json states it: 48 layers, three Gated DeltaNet layers to
# one gated attention layer, 512 experts (top-10) and a gated shared expert. Its experts are
# 150 GB in BF16.
QWEN3_NEXT_80B_A3B: dict[str, Any] = dict(
    model_type="qwen3_next",
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=5120,
    num_hidden_layers=48,
    full_attention_interval=4,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=256,
    partial_rotary_factor=0.25,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    num_experts=512,
    num_experts_per_tok=10,
    moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
    norm_topk_prob=True,
    rms_norm_eps=1e-6,
    rope_theta=10000000.0,
    max_position_embeddings=262144,
    tie_word_embeddings=False,
)

SHAPES: dict[str, dict[str, Any]] = {
    "glm-4.5-air": GLM_4_5_AIR,
    "tiny-glm4-moe": {  # the same layers at the size of a CPU test
        **GLM_4_5_AIR,
        "vocab_size": 4096,
        "hidden_size": 256,
        "intermediate_size": 512,
        "moe_intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "n_routed_experts": 16,
        "num_experts_per_tok": 4,
    },
    # the depth whose BF16 experts fit a 128 GiB host beside the rest (15 MoE layers, 66 GB)
    "glm-4.5-air-16": {**GLM_4_5_AIR, "num_hidden_layers": 16},
    "gpt-oss-120b": GPT_OSS_120B,
    # the depth whose BF16 experts fit a 128 GiB host beside the rest (12 layers, 76 GB)
    "gpt-oss-120b-12": {**GPT_OSS_120B, "num_hidden_layers": 12},
    "tiny-gpt-oss": {  # the same layers at the size of a CPU test
        **GPT_OSS_120B,
        "vocab_size": 4096,
        "hidden_size": 256,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "num_local_experts": 16,
        "sliding_window": 8,
    },
    "qwen3-next-80b-a3b": QWEN3_NEXT_80B_A3B,
    "tiny-qwen3-next": {  # the same layers at the size of a CPU test
        **QWEN3_NEXT_80B_A3B,
        "vocab_size": 4096,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "head_dim": 64,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 128,
    },
    "qwen3-30b-a3b": QWEN3_30B_A3B,
    "qwen3-30b-a3b-half": {**QWEN3_30B_A3B, "num_hidden_layers": 24},
    "tiny": {
        **QWEN3_30B_A3B,
        "vocab_size": 4096,
        "hidden_size": 256,
        "intermediate_size": 512,
        "moe_intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "num_experts": 16,
        "num_experts_per_tok": 4,
    },
}
