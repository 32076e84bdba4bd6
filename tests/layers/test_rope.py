"""Rotary embeddings' options: partial rotary (the first R dimensions of each head) and
rotation by adjacent pairs, against rotate-half on the same data; the one-kernel head norm
with rotary falls back to the torch code for partial rotary."""

import pytest
import torch

from freetoken.layers import fused, norm
from freetoken.layers.rope import RotaryEmbedding, apply_rope


def test_partial_rotary_rotates_the_first_dims_only():
    g = torch.Generator().manual_seed(3)
    x = torch.randn((5, 3, 32), generator=g)
    cos, sin = RotaryEmbedding(16, 1e4)(torch.tensor([0, 1, 7, 100, 3]), torch.float32)
    got = apply_rope(x, cos, sin)
    assert torch.equal(got[..., 16:], x[..., 16:])
    assert torch.allclose(got[..., :16], apply_rope(x[..., :16].contiguous(), cos, sin))
    assert not torch.allclose(got[..., :16], x[..., :16])


def test_rotating_pairs_of_permuted_rows_gives_the_same_scores():
    """llama.cpp's converter interleaves each head's two halves (rows i and D/2 + i become
    2i and 2i + 1); rotating pairs then gives q and k permuted alike, so the same q·k."""
    g = torch.Generator().manual_seed(4)
    T, D = 6, 16
    q, k = torch.randn((T, 2, D), generator=g), torch.randn((T, 2, D), generator=g)
    perm = torch.stack((torch.arange(D // 2), torch.arange(D // 2, D)), dim=1).flatten()
    positions = torch.tensor([0, 3, 9, 1, 40, 2])
    cos, sin = RotaryEmbedding(D, 1e4)(positions, torch.float32)
    pcos, psin = RotaryEmbedding(D, 1e4, pairs=True)(positions, torch.float32)
    half = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    pairs = apply_rope(q[..., perm], pcos, psin, True), apply_rope(k[..., perm], pcos, psin, True)
    assert torch.allclose(pairs[0], half[0][..., perm], atol=1e-6)
    scores = torch.einsum("thd,shd->hts", *half)
    assert torch.allclose(torch.einsum("thd,shd->hts", *pairs), scores, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_norm_with_partial_rotary_on_a_gpu(dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator().manual_seed(5)
    x = torch.randn((7, 4, 128), generator=g).to(dtype).cuda()
    w = (torch.rand(128, generator=g) + 0.5).to(dtype).cuda()
    cos, sin = RotaryEmbedding(64, 1e6).cuda()(torch.arange(7).cuda() * 13, dtype)
    got = norm.head_norm_rope(x, w, 1e-6, cos, sin)
    with fused.disabled():
        want = apply_rope(norm.rms_norm(x, w, 1e-6), cos, sin)
    assert torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2)
