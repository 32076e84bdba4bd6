"""DeepSeek-V4's compressors against transformers' (run without a cache, which compresses
every whole window of a prompt at once): heavily compressed windows, and compressed sparse
attention's overlapping ones, from the inputs of each window's span as the pool keeps them;
YaRN on the entries' rope."""

from __future__ import annotations

import math

import pytest
import torch

from freetoken.layers.compressor import Compressor
from freetoken.layers.rope_scaling import RopeScaling
from freetoken.models import deepseek_v4

H, D, S = 32, 16, 24
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}


def _reference(kind: str, ratio: int, seed: int):
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m

    cfg = DeepseekV4Config(
        hidden_size=H,
        head_dim=D,
        q_lora_rank=8,
        index_head_dim=8,
        index_n_heads=2,
        num_hidden_layers=1,
        vocab_size=8,
        partial_rotary_factor=0.5,
        compress_rates={kind: ratio},
        rope_parameters=YARN,
    )
    cls = m.DeepseekV4CSACompressor if kind == deepseek_v4.SPARSE else m.DeepseekV4HCACompressor
    ref = cls(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    return ref, cfg


@pytest.mark.parametrize("kind,ratio", [(deepseek_v4.HEAVY, 8), (deepseek_v4.SPARSE, 4)])
def test_entries_match_transformers(kind, ratio):
    ref, cfg = _reference(kind, ratio, seed=ratio)
    compress = cfg.rope_parameters["compress"]
    scaling = RopeScaling.from_params(compress, cfg.max_position_embeddings)
    ours = Compressor(
        H, D, ratio, kind == deepseek_v4.SPARSE, cfg.rms_norm_eps, 8, 160000.0, scaling
    )
    state = {k: v for k, v in ref.state_dict().items() if not k.startswith(("indexer.", "rotary"))}
    ours.load_state_dict(state, strict=False)  # the rope tables are computed, not loaded
    x = torch.randn(S, H)
    with torch.no_grad():
        want = ref(x[None], torch.randn(1, S, 8), torch.arange(S)[None], None, 0)[0][0, 0]
        raw = ours.inputs(x)
        windows = torch.arange(S // ratio)
        at = (windows * ratio - (ours.span - ratio))[:, None] + torch.arange(ours.span)
        valid = at >= 0
        got = ours.pool(raw[at.clamp(min=0)], valid, windows)
    assert got.shape == want.shape == (S // ratio, D)
    assert torch.allclose(got, want, atol=1e-5)
