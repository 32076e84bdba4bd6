"""Sliding-window attention, in prefill and decode, against a plain softmax written out
here (float64, every key scored, the window applied by hand): the torch code everywhere,
the decode kernel on a GPU and by Triton's interpreter (many context lengths, windows and
split counts)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from freetoken.layers import attention, fused
from freetoken.layers.context import DecodeView
from tests.layers.test_attention import PAGE

# sequences' lengths, padded context, heads, KV heads, head dim, window: windows
# shorter, longer and as long as the contexts, one to many splits, splits past the length
CASES = [
    ((1, 37, 64), 64, 8, 2, 64, 16),
    ((200, 3), 256, 4, 4, 32, 128),
    ((130, 2), 512, 4, 2, 32, 1),
    ((5, 300, 1024, 700), 1024, 8, 2, 64, 300),
    ((1, 299, 300, 301, 1000), 1024, 8, 2, 32, 300),
    ((10,), 1024, 4, 2, 32, 600),
    ((2000, 700, 5), 2048, 4, 1, 64, 1000),
    ((600, 17), 1024, 4, 2, 32, 4096),
]


def explicit(q, k, v, qpos, kpos, scale, window=0):
    """softmax(q·k·scale over the visible keys) · v, in float64: q [n, H, D],
    k/v [S, KVH, D], query and key positions [n] and [S]."""
    G = q.shape[1] // k.shape[1]
    kk, vv = (t.double().repeat_interleave(G, dim=1) for t in (k, v))
    s = torch.einsum("nhd,shd->hns", q.double(), kk) * scale
    visible = kpos[None, :] <= qpos[:, None]
    if window:
        visible &= kpos[None, :] > qpos[:, None] - window
    s = s.masked_fill(~visible[None], float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.einsum("hns,shd->nhd", p, vv)


def decode_case(lens, max_ctx, H, KVH, D, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, P = len(lens), max_ctx // PAGE
    pages = B * P + 3
    k_pool = torch.randn((pages * PAGE, KVH, D), generator=g).to(dtype)
    v_pool = torch.randn((pages * PAGE, KVH, D), generator=g).to(dtype)
    table = torch.randperm(pages, generator=g)[: B * P].view(B, P)
    q = (2 * torch.randn((B, H, D), generator=g)).to(dtype)  # peaked enough for windows to matter
    view = DecodeView(
        block_table=table.to(device), lens=torch.tensor(lens).to(device), page_size=PAGE
    )
    return q.to(device), k_pool.to(device), v_pool.to(device), view


def decode_reference(q, k_pool, v_pool, view, scale, window):
    rows = []
    for b, n in enumerate(view.lens.tolist()):
        pos = torch.arange(n)
        slots = view.block_table[b].cpu()[pos // PAGE] * PAGE + pos % PAGE
        k, v = k_pool.cpu()[slots], v_pool.cpu()[slots]
        rows.append(explicit(q[b : b + 1].cpu(), k, v, torch.tensor([n - 1]), pos, scale, window))
    return torch.cat(rows)


def close(got, want, dtype):
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    return got.shape == want.shape and torch.allclose(got.double().cpu(), want, **tol)


@pytest.mark.parametrize("lens,max_ctx,H,KVH,D,window", CASES)
def test_torch_decode_matches_the_explicit_softmax(lens, max_ctx, H, KVH, D, window):
    q, k, v, view = decode_case(lens, max_ctx, H, KVH, D, torch.float32, "cpu")
    with fused.disabled():
        view.derive()
        got = attention.decode_attention(q, k, v, view, D**-0.5, window)
    assert close(got, decode_reference(q, k, v, view, D**-0.5, window), torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens,max_ctx,H,KVH,D,window", CASES)
def test_fused_decode_options_match_on_a_gpu(lens, max_ctx, H, KVH, D, window, dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    q, k, v, view = decode_case(lens, max_ctx, H, KVH, D, dtype, "cuda")
    got = attention.decode_attention(q, k, v, view, D**-0.5, window)
    assert got.dtype == dtype
    assert close(got, decode_reference(q, k, v, view, D**-0.5, window), dtype)


INTERPRET = (
    os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
)


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and triton")
@pytest.mark.parametrize("lens,max_ctx,H,KVH,D,window", CASES)
def test_decode_kernel_options_in_the_interpreter(lens, max_ctx, H, KVH, D, window):
    q, k, v, view = decode_case(lens, max_ctx, H, KVH, D, torch.float32, "cpu")
    got = attention._decode_fused(q, k, v, view, D**-0.5, window)
    assert close(got, decode_reference(q, k, v, view, D**-0.5, window), torch.float32)


def test_split_counts_follow_the_window():
    view = DecodeView(
        block_table=torch.zeros((1, 2048 // PAGE), dtype=torch.long), lens=None, page_size=PAGE
    )
    assert attention.decode_splits(view) == 8
    assert [attention.decode_splits(view, w) for w in (1, 256, 257, 1000, 4096)] == [1, 1, 2, 4, 8]


# chunk length, context after it, KV heads, window: a whole prompt, later chunks, one
# token; windows shorter and longer than the chunk
PREFILL = [
    (12, 12, 2, 5),
    (12, 12, 4, 0),
    (7, 30, 2, 9),
    (7, 30, 1, 40),
    (1, 30, 2, 9),
    (5, 9, 4, 1),
]


@pytest.mark.parametrize("n,ctx_len,KVH,window", PREFILL)
def test_prefill_matches_the_explicit_softmax(n, ctx_len, KVH, window):
    g = torch.Generator().manual_seed(n * 100 + ctx_len)
    H, D = 4, 16
    q = 2 * torch.randn((n, H, D), generator=g)
    k, v = torch.randn((ctx_len, KVH, D), generator=g), torch.randn((ctx_len, KVH, D), generator=g)
    got = attention.prefill_attention(q, k, v, ctx_len, D**-0.5, window)
    qpos, kpos = torch.arange(ctx_len - n, ctx_len), torch.arange(ctx_len)
    assert close(got, explicit(q, k, v, qpos, kpos, D**-0.5, window), torch.float32)
