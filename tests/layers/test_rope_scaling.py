"""Rope scaling (linear, YaRN with DeepSeek's mscale and gpt-oss's truncate) and the
interleaved rotary layout, against transformers' own rope functions."""

from __future__ import annotations

import math

import pytest
import torch

from freetoken.layers.rope_scaling import (
    RopeScaling,
    ScaledRotaryEmbedding,
    apply_rope_interleaved,
    inv_freq,
)
from freetoken.models import hub

DEEPSEEK_V3 = {
    "type": "yarn",
    "factor": 40,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
DEEPSEEK_V2 = {**DEEPSEEK_V3, "mscale": 0.707, "mscale_all_dim": 0.707}
UNEVEN = {**DEEPSEEK_V3, "mscale": 1.0, "mscale_all_dim": 0.5, "factor": 16}
NO_MSCALE = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}
GPT_OSS = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "original_max_position_embeddings": 4096,
    "truncate": False,
}
LINEAR = {"type": "linear", "factor": 4.0}
SETTINGS = [DEEPSEEK_V3, DEEPSEEK_V2, UNEVEN, NO_MSCALE, GPT_OSS, LINEAR, None]


def _deepseek_config(scaling, theta=10000.0, rope_dim=64, max_pos=163840):
    """A transformers DeepSeek-V3 config from the Hub spelling (rope_scaling + rope_theta)."""
    from transformers import DeepseekV3Config

    cfg = {"rope_scaling": dict(scaling) if scaling else None, "rope_theta": theta}
    hf = DeepseekV3Config(
        qk_rope_head_dim=rope_dim, max_position_embeddings=max_pos, **{k: v for k, v in cfg.items()}
    )
    return hf, {**cfg, "max_position_embeddings": max_pos}


def _ours(config: dict) -> RopeScaling:
    return RopeScaling.from_params(hub.rope_parameters(config), config["max_position_embeddings"])


def _reference(hf):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kind = hf.rope_parameters["rope_type"]
    if kind == "default":
        d = hf.head_dim
        base = hf.rope_parameters["rope_theta"]
        return 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float) / d)), 1.0
    return ROPE_INIT_FUNCTIONS[kind](hf)


@pytest.mark.parametrize("scaling", SETTINGS)
def test_deepseek_frequencies_and_attention_factor(scaling):
    hf, config = _deepseek_config(scaling)
    want, factor = _reference(hf)
    got, our_factor = inv_freq(64, hub.rope_theta(config), _ours(config))
    assert torch.equal(got, want.float())
    assert our_factor == pytest.approx(factor, rel=1e-12)


@pytest.mark.parametrize("scaling", SETTINGS)
def test_mla_softmax_scale_matches_deepseek_attention(scaling):
    """DeepSeek scales the softmax by mscale(factor, mscale_all_dim)² on top of 1/√d."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    hf, config = _deepseek_config(scaling)
    want = yarn_apply_mscale(hf.rope_parameters, 192**-0.5)
    assert _ours(config).softmax_scale(192) == pytest.approx(want, rel=1e-12)


def test_gpt_oss_yarn_without_truncation():
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    # transformers 5's own spelling: rope_parameters holds rope_theta
    params = {**GPT_OSS, "rope_theta": 150000.0}
    hf = GptOssConfig(rope_parameters=dict(params), max_position_embeddings=131072)
    want, factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    config = {"rope_parameters": params, "max_position_embeddings": 131072}
    s = _ours(config)
    assert not s.truncate and s.factor == 32.0
    got, our_factor = inv_freq(64, hub.rope_theta(config), s)
    assert torch.equal(got, want)
    assert our_factor == pytest.approx(factor) == pytest.approx(0.1 * math.log(32) + 1)
    truncated, _ = inv_freq(64, 150000.0, RopeScaling(**{**s.__dict__, "truncate": True}))
    assert not torch.equal(truncated, got)  # the setting changes the ramp


def test_rotary_embedding_matches_deepseek_cos_sin():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    hf, config = _deepseek_config(UNEVEN, theta=50000.0, rope_dim=32)
    ref = DeepseekV3RotaryEmbedding(hf)
    positions = torch.tensor([0, 1, 7, 4095, 4096, 100000])
    x = torch.zeros(1, dtype=torch.float32)
    cos_ref, sin_ref = ref(x, positions[None])
    ours = ScaledRotaryEmbedding(32, hub.rope_theta(config), _ours(config))
    cos, sin = ours(positions, torch.float32)
    assert ours.attention_factor != 1.0
    assert torch.allclose(cos, cos_ref[0], rtol=1e-6, atol=1e-6)
    assert torch.allclose(sin, sin_ref[0], rtol=1e-6, atol=1e-6)


def test_interleaved_rope_matches_deepseek_and_keeps_dot_products():
    """Equal to transformers' interleaved rotation (DeepSeek-V3), and every query-key dot
    product equals that of DeepSeek-V2's complex-number form (whose output keeps pairs)."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import apply_rotary_emb
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        apply_rotary_pos_emb_interleave,
    )

    g = torch.Generator().manual_seed(0)
    T, H, D = 5, 3, 16
    q, k = torch.randn((T, H, D), generator=g), torch.randn((T, 1, D), generator=g)
    rope = ScaledRotaryEmbedding(D, 10000.0)
    positions = torch.tensor([0, 3, 9, 30, 511])
    cos, sin = rope(positions, torch.float32)
    q_ref, k_ref = apply_rotary_pos_emb_interleave(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None]
    )
    qo, ko = apply_rope_interleaved(q, cos, sin), apply_rope_interleaved(k, cos, sin)
    assert torch.allclose(qo, q_ref[0].transpose(0, 1), atol=1e-6)
    assert torch.allclose(ko, k_ref[0].transpose(0, 1), atol=1e-6)
    freqs = torch.polar(torch.ones(T, D // 2), positions.float()[:, None] * rope.inv_freq)
    q2, k2 = apply_rotary_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], freqs[None])
    dots = torch.einsum("thd,sd->hts", qo, ko[:, 0])
    dots2 = torch.einsum("htd,sd->hts", q2[0], k2[0, 0])
    assert torch.allclose(dots, dots2, atol=1e-5)


def test_spellings_agree():
    """rope_scaling with `type` (Hub) and rope_parameters with `rope_type` (transformers 5)."""
    hub_style = {"rope_scaling": DEEPSEEK_V3, "rope_theta": 10000.0}
    params = {**{k: v for k, v in DEEPSEEK_V3.items() if k != "type"}, "rope_type": "yarn"}
    tf5 = {"rope_parameters": {**params, "rope_theta": 10000.0}}
    for c in (hub_style, tf5):
        c["max_position_embeddings"] = 163840
    assert _ours(hub_style) == _ours(tf5)
    assert hub.rope_theta(hub_style) == hub.rope_theta(tf5) == 10000.0
    with pytest.raises(ValueError, match="unsupported rope scaling"):
        RopeScaling.from_params({"rope_type": "longrope"}, 4096)
