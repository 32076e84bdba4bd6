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

SHAPES: dict[str, dict[str, Any]] = {
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
