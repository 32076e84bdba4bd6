"""The attention layer's projection options against transformers' own attention modules of
the families that use them, over one prompt (fp32): q/k/v biases with or without an output
bias, q/k RMSNorm per head or over the whole projection, clipped q/k/v, partial rotary."""

from __future__ import annotations

import math

import pytest
import torch

from freetoken.layers.attention import Attention
from freetoken.layers.context import KVStore, SeqSpan, StepContext, step_context
from freetoken.layers.rope import RotaryEmbedding

T, HIDDEN, HEADS, KV_HEADS = 9, 64, 4, 2


def _qwen2_moe():
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import (
        Qwen2MoeAttention,
        Qwen2MoeRotaryEmbedding,
    )

    cfg = Qwen2MoeConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=2)
    kw = dict(bias=True, o_bias=False)
    return cfg, Qwen2MoeAttention, Qwen2MoeRotaryEmbedding, kw, HIDDEN // HEADS, 1.0


def _olmoe():
    from transformers import OlmoeConfig
    from transformers.models.olmoe.modeling_olmoe import OlmoeAttention, OlmoeRotaryEmbedding

    cfg = OlmoeConfig(
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=2,
        attention_bias=True,
        clip_qkv=0.9,
    )
    kw = dict(qk_norm="full", bias=True, clip_qkv=0.9, eps=cfg.rms_norm_eps)
    return cfg, OlmoeAttention, OlmoeRotaryEmbedding, kw, HIDDEN // HEADS, 1.0


def _glm4_moe():
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import (
        Glm4MoeAttention,
        Glm4MoeRotaryEmbedding,
    )

    cfg = Glm4MoeConfig(
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=2,
        head_dim=32,
        attention_bias=True,
        use_qk_norm=True,
        partial_rotary_factor=0.5,
    )
    kw = dict(qk_norm="head", bias=True, o_bias=False, eps=cfg.rms_norm_eps)
    return cfg, Glm4MoeAttention, Glm4MoeRotaryEmbedding, kw, 32, 0.5


def _minimax_m2():
    from transformers import MiniMaxM2Config
    from transformers.models.minimax_m2.modeling_minimax_m2 import (
        MiniMaxM2Attention,
        MiniMaxM2RotaryEmbedding,
    )

    cfg = MiniMaxM2Config(
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=2,
        head_dim=16,
        rotary_dim=8,
    )
    kw = dict(qk_norm="full", eps=cfg.rms_norm_eps)
    return cfg, MiniMaxM2Attention, MiniMaxM2RotaryEmbedding, kw, 16, 0.5


def _randomize(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))


def ours(attn: Attention, x: torch.Tensor, rope) -> torch.Tensor:
    """The layer over one sequence of T tokens, its cache a pool of T slots."""
    kv = KVStore()
    kv.k = [torch.zeros(T, attn.n_kv_heads, attn.head_dim)]
    kv.v = [torch.zeros(T, attn.n_kv_heads, attn.head_dim)]
    slots = torch.arange(T)
    ctx = StepContext(torch.arange(T), slots, [SeqSpan(0, T, T, slots)], kv, torch.arange(T))
    with torch.no_grad(), step_context(ctx):
        return attn(x, rope)


@pytest.mark.parametrize("family", [_qwen2_moe, _olmoe, _glm4_moe, _minimax_m2])
def test_attention_matches_the_reference_module(family):
    cfg, attn_cls, rope_cls, kw, head_dim, partial = family()
    cfg._attn_implementation = "eager"
    ref = attn_cls(cfg, 0).eval()
    _randomize(ref, 0)
    attn = Attention(0, HIDDEN, HEADS, KV_HEADS, head_dim, **kw)
    attn.load_state_dict(ref.state_dict())
    x = torch.randn((T, HIDDEN), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(T)
    rotary = RotaryEmbedding(int(head_dim * partial), cfg.rope_parameters["rope_theta"])
    got = ours(attn, x, rotary(positions, torch.float32))
    causal = torch.full((T, T), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        emb = rope_cls(cfg)(x[None], positions[None])
        want, _ = ref(x[None], position_embeddings=emb, attention_mask=causal)
    assert torch.allclose(got, want[0], rtol=1e-5, atol=1e-5)
