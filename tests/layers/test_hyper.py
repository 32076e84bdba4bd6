"""Hyper-connections against transformers' DeepSeek-V4 modules: the weights a block's
streams give (pre folded into the block's input, post, comb), the merge around a block, and
the final head."""

from __future__ import annotations

import pytest
import torch

from freetoken.layers.hyper import HyperConnection, HyperHead

H, T = 16, 5


def _config(n: int, iters: int):
    from transformers import DeepseekV4Config

    return DeepseekV4Config(
        hidden_size=H, hc_mult=n, hc_sinkhorn_iters=iters, num_hidden_layers=1, vocab_size=8
    )


def _fill(*modules, seed):
    g = torch.Generator().manual_seed(seed)
    params = [dict(m.named_parameters()) for m in modules]
    with torch.no_grad():
        for name, p in params[0].items():
            value = torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 1.0)
            for ps in params:
                ps[name].copy_(value)


@pytest.mark.parametrize("n,iters", [(2, 5), (4, 20)])
def test_weights_and_merge_match_deepseek_v4(n, iters):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection

    ref = DeepseekV4HyperConnection(_config(n, iters))
    ours = HyperConnection(H, n, iters, 1e-6, 1e-6)
    _fill(ref, ours, seed=n)
    streams = torch.randn(T, n, H)
    post0, comb0, x0 = ref(streams[None])
    post, comb, x = ours(streams)
    for a, b in ((post, post0[0]), (comb, comb0[0]), (x, x0[0])):
        assert torch.allclose(a, b, atol=1e-6)
    assert torch.allclose(comb.sum(-2), torch.ones(T, n), atol=1e-5)  # columns, last made so
    out = torch.randn(T, H)
    want = post0[0, ..., None] * out[:, None] + comb0[0].transpose(-1, -2) @ streams
    assert torch.allclose(HyperConnection.merge(streams, out, post, comb), want, atol=1e-6)


def test_head_matches_deepseek_v4():
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperHead

    ref = DeepseekV4HyperHead(_config(3, 1))
    ours = HyperHead(H, 3, 1e-6, 1e-6)
    _fill(ref, ours, seed=9)
    streams = torch.randn(T, 3, H)
    assert torch.allclose(ours(streams), ref(streams[None])[0], atol=1e-6)
