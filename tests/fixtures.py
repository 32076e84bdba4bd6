"""Tiny reference models built with `transformers` (the independent reference).

Weights are re-randomised after construction (matrices ~ randn/sqrt(fan_in), vectors
1 + 0.1·randn) so that routing margins are large enough for exact fp32 comparisons.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from freetoken.tools import synth

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)


# The smallest real Qwen3-MoE: loads in about a second on a CPU (server, store and CLI tests).
SYNTH_TINY = dict(
    hidden_size=32,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    num_experts=4,
    num_experts_per_tok=2,
)


def rerandomize(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))


def hf_qwen3_moe(
    out: Path,
    *,
    seed: int = 0,
    fused: bool = False,
    shard_size: str | None = None,
    hub_config: bool = True,
    vocab_size: int = 512,
    **overrides: Any,
):
    """Writes a tiny Qwen3-MoE HF directory (with tokenizer) and returns the fp32 HF model.

    fused: save transformers' in-memory layout (gate_up_proj/down_proj) instead of the
    per-expert Hub layout. hub_config: rewrite config.json in the spelling real Hub
    checkpoints use (num_experts, rope_theta) instead of transformers 5's.
    """
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    vocab = synth.write_tokenizer_files(out, vocab_size)
    kw = {**TINY, **overrides}
    rope_theta = kw.pop("rope_theta")
    cfg = Qwen3MoeConfig(
        vocab_size=vocab, rope_parameters={"rope_type": "default", "rope_theta": rope_theta}, **kw
    )
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg).to(torch.float32).eval()
    rerandomize(model, seed)
    save_kw: dict[str, Any] = {"save_original_format": not fused}
    if shard_size:
        save_kw["max_shard_size"] = shard_size
    model.save_pretrained(out, **save_kw)
    tok = json.loads((out / "tokenizer.json").read_text())
    eos = next(a["id"] for a in tok["added_tokens"] if a["content"] == "<|im_end|>")
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    if hub_config:
        c = json.loads((out / "config.json").read_text())
        c.pop("rope_parameters", None)
        c["rope_theta"] = rope_theta
        if "num_local_experts" in c:
            c["num_experts"] = c.pop("num_local_experts")
        c["torch_dtype"] = "float32"
        (out / "config.json").write_text(json.dumps(c, indent=2))
    return model


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


def hf_model(
    out: Path,
    config_cls: type,
    model_cls: type,
    config: dict[str, Any],
    *,
    seed: int = 0,
    vocab_size: int = 512,
    original_format: bool = True,
    rerandomize_params=None,
):
    """Writes a tiny Hugging Face directory of any family (tokenizer, config, weights) and
    returns the fp32 transformers model it holds; `config` is the family's config kwargs
    (vocab_size comes from the tokenizer). `rerandomize_params` replaces `rerandomize` for
    families whose parameters need other ranges (a router bias, sinks)."""
    out.mkdir(parents=True, exist_ok=True)
    vocab = synth.write_tokenizer_files(out, vocab_size)
    cfg = config_cls(vocab_size=vocab, **config)
    torch.manual_seed(seed)
    model = model_cls(cfg).to(torch.float32).eval()
    (rerandomize_params or rerandomize)(model, seed)
    model.save_pretrained(out, save_original_format=original_format)
    tok = json.loads((out / "tokenizer.json").read_text())
    eos = next(a["id"] for a in tok["added_tokens"] if a["content"] == "<|im_end|>")
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    c = json.loads((out / "config.json").read_text())
    c["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(c, indent=2))
    return model
