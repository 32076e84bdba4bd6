"""Sliding-window attention and attention sinks, in prefill and decode, against a plain
softmax written out here (float64, every key scored, the window and the sink applied by
hand), and the sink's meaning against transformers' gpt-oss attention: the torch code
everywhere, the decode kernel on a GPU and by Triton's interpreter (many context lengths,
windows and split counts)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from freetoken.layers import attention, fused
from freetoken.layers.context import DecodeView
from tests.layers.test_attention import PAGE

# sequences' lengths, padded context, heads, KV heads, head dim, window, sinks: windows
# shorter, longer and as long as the contexts, one to many splits, splits past the length
CASES = [
    ((1, 37, 64), 64, 8, 2, 64, 16, False),
    ((1, 37, 64), 64, 8, 2, 64, 0, True),
    ((200, 3), 256, 4, 4, 32, 128, False),
    ((200, 3), 256, 4, 4, 32, 128, True),
    ((130, 2), 512, 4, 2, 32, 1, False),
    ((130, 2), 512, 4, 2, 32, 1, True),
    ((5, 300, 1024, 700), 1024, 8, 2, 64, 300, False),
    ((5, 300, 1024), 1024, 32, 4, 128, 0, True),
    ((1, 299, 300, 301, 1000), 1024, 8, 2, 32, 300, False),
    ((1, 299, 300, 301, 1000), 1024, 8, 2, 32, 300, True),
    ((10,), 1024, 4, 2, 32, 600, False),
    ((10,), 1024, 4, 2, 32, 600, True),
    ((2000, 700, 5), 2048, 4, 1, 64, 1000, False),
    ((2000, 700, 5), 2048, 4, 1, 64, 1000, True),
    ((600, 17), 1024, 4, 2, 32, 4096, False),
]


def explicit(q, k, v, qpos, kpos, scale, window=0, sinks=None):
    """softmax(q·k·scale over the visible keys, and the sink) · v, in float64: q [n, H, D],
    k/v [S, KVH, D], query and key positions [n] and [S]."""
    G = q.shape[1] // k.shape[1]
    kk, vv = (t.double().repeat_interleave(G, dim=1) for t in (k, v))
    s = torch.einsum("nhd,shd->hns", q.double(), kk) * scale
    visible = kpos[None, :] <= qpos[:, None]
    if window:
        visible &= kpos[None, :] > qpos[:, None] - window
    s = s.masked_fill(~visible[None], float("-inf"))
    if sinks is not None:
        sink = sinks.double()[:, None, None].expand(-1, s.shape[1], 1)
        s = torch.cat((s, sink), dim=-1)
    p = torch.softmax(s, dim=-1)[..., : k.shape[0]]
    return torch.einsum("hns,shd->nhd", p, vv)


def decode_case(lens, max_ctx, H, KVH, D, sinks, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, P = len(lens), max_ctx // PAGE
    pages = B * P + 3
    k_pool = torch.randn((pages * PAGE, KVH, D), generator=g).to(dtype)
    v_pool = torch.randn((pages * PAGE, KVH, D), generator=g).to(dtype)
    table = torch.randperm(pages, generator=g)[: B * P].view(B, P)
    q = (2 * torch.randn((B, H, D), generator=g)).to(dtype)  # peaked enough for windows to matter
    s = (torch.randn(H, generator=g) * 2).to(dtype) if sinks else None
    view = DecodeView(
        block_table=table.to(device), lens=torch.tensor(lens).to(device), page_size=PAGE
    )
    return (
        q.to(device),
        k_pool.to(device),
        v_pool.to(device),
        view,
        None if s is None else s.to(device),
    )


def decode_reference(q, k_pool, v_pool, view, scale, window, sinks):
    rows = []
    for b, n in enumerate(view.lens.tolist()):
        pos = torch.arange(n)
        slots = view.block_table[b].cpu()[pos // PAGE] * PAGE + pos % PAGE
        k, v = k_pool.cpu()[slots], v_pool.cpu()[slots]
        qpos = torch.tensor([n - 1])
        s = None if sinks is None else sinks.cpu()
        rows.append(explicit(q[b : b + 1].cpu(), k, v, qpos, pos, scale, window, s))
    return torch.cat(rows)


def close(got, want, dtype):
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    return got.shape == want.shape and torch.allclose(got.double().cpu(), want, **tol)


@pytest.mark.parametrize("lens,max_ctx,H,KVH,D,window,sinks", CASES)
def test_torch_decode_matches_the_explicit_softmax(lens, max_ctx, H, KVH, D, window, sinks):
    q, k, v, view, s = decode_case(lens, max_ctx, H, KVH, D, sinks, torch.float32, "cpu")
    with fused.disabled():
        view.derive()
        got = attention.decode_attention(q, k, v, view, D**-0.5, window, s)
    assert close(got, decode_reference(q, k, v, view, D**-0.5, window, s), torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens,max_ctx,H,KVH,D,window,sinks", CASES)
def test_fused_decode_options_match_on_a_gpu(lens, max_ctx, H, KVH, D, window, sinks, dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    q, k, v, view, s = decode_case(lens, max_ctx, H, KVH, D, sinks, dtype, "cuda")
    got = attention.decode_attention(q, k, v, view, D**-0.5, window, s)
    assert got.dtype == dtype
    assert close(got, decode_reference(q, k, v, view, D**-0.5, window, s), dtype)


INTERPRET = (
    os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
)


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and triton")
@pytest.mark.parametrize("lens,max_ctx,H,KVH,D,window,sinks", CASES)
def test_decode_kernel_options_in_the_interpreter(lens, max_ctx, H, KVH, D, window, sinks):
    q, k, v, view, s = decode_case(lens, max_ctx, H, KVH, D, sinks, torch.float32, "cpu")
    got = attention._decode_fused(q, k, v, view, D**-0.5, window, s)
    assert close(got, decode_reference(q, k, v, view, D**-0.5, window, s), torch.float32)


def test_split_counts_follow_the_window():
    view = DecodeView(
        block_table=torch.zeros((1, 2048 // PAGE), dtype=torch.long), lens=None, page_size=PAGE
    )
    assert attention.decode_splits(view) == 8
    assert [attention.decode_splits(view, w) for w in (1, 256, 257, 1000, 4096)] == [1, 1, 2, 4, 8]


# chunk length, context after it, KV heads, window, sinks: a whole prompt, later chunks,
# one token; windows shorter and longer than the chunk
PREFILL = [
    (12, 12, 2, 5, False),
    (12, 12, 2, 0, True),
    (12, 12, 4, 5, True),
    (7, 30, 2, 9, True),
    (7, 30, 1, 40, False),
    (1, 30, 2, 9, True),
    (1, 30, 2, 0, True),
    (5, 9, 4, 1, False),
]


def prefill_matches(n, ctx_len, KVH, window, sinks, device="cpu", D=16):
    g = torch.Generator().manual_seed(n * 100 + ctx_len)
    H = 4
    q = 2 * torch.randn((n, H, D), generator=g)
    k, v = torch.randn((ctx_len, KVH, D), generator=g), torch.randn((ctx_len, KVH, D), generator=g)
    s = 2 * torch.randn(H, generator=g) if sinks else None
    on = [None if t is None else t.to(device) for t in (q, k, v, s)]
    got = attention.prefill_attention(*on[:3], ctx_len, D**-0.5, window, on[3])
    qpos, kpos = torch.arange(ctx_len - n, ctx_len), torch.arange(ctx_len)
    return close(got, explicit(q, k, v, qpos, kpos, D**-0.5, window, s), torch.float32)


@pytest.mark.parametrize("n,ctx_len,KVH,window,sinks", PREFILL)
def test_prefill_matches_the_explicit_softmax(n, ctx_len, KVH, window, sinks):
    assert prefill_matches(n, ctx_len, KVH, window, sinks)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [16, 32, 64])
@pytest.mark.parametrize("n,ctx_len,KVH,window,sinks", PREFILL)
def test_prefill_options_match_on_a_gpu(n, ctx_len, KVH, window, sinks, D):
    """fp32 on CUDA: whichever SDPA backend runs (memory-efficient, for GQA with a mask)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    assert prefill_matches(n, ctx_len, KVH, window, sinks, "cuda", D)


def test_sinks_give_sdpa_one_head_dim(monkeypatch):
    """The sink path hands SDPA q, k and v of one head dim, in prefill and decode, and still
    gives the explicit softmax: of the families' SDPA calls on an H200, the one with v
    narrower than q/k beside GQA and a mask (CUDA's memory-efficient kernel in fp32) was
    the one whose logits were wrong (see sdpa_with_sinks)."""
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen.append((q.shape[-1], k.shape[-1], v.shape[-1]))
        return sdpa(q, k, v, **kw)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    for n, ctx_len, KVH, window in [(12, 12, 2, 5), (12, 12, 2, 0), (7, 30, 1, 9)]:
        assert prefill_matches(n, ctx_len, KVH, window, True, D=32)
    q, k, v, view, s = decode_case((1, 37, 64), 64, 8, 2, 32, True, torch.float32, "cpu")
    with fused.disabled():
        view.derive()
        got = attention.decode_attention(q, k, v, view, 32**-0.5, 16, s)
    assert close(got, decode_reference(q, k, v, view, 32**-0.5, 16, s), torch.float32)
    assert len(seen) == 4 and all(dq == dk == dv for dq, dk, dv in seen), seen


def test_sinks_mean_what_gpt_oss_means():
    """transformers' gpt-oss attention (its eager softmax over scores and sinks) over a
    sliding-window mask gives what prefill attention gives."""
    from transformers.models.gpt_oss import modeling_gpt_oss

    g = torch.Generator().manual_seed(7)
    n, H, KVH, D, window = 10, 4, 2, 16, 4
    q = 2 * torch.randn((n, H, D), generator=g)
    k, v = torch.randn((n, KVH, D), generator=g), torch.randn((n, KVH, D), generator=g)
    module = torch.nn.Module()
    module.sinks, module.num_key_value_groups, module.training = (
        torch.randn(H, generator=g),
        2,
        False,
    )
    pos = torch.arange(n)
    visible = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
    additive = torch.zeros((n, n)).masked_fill(~visible, float("-inf"))[None, None]
    want, _ = modeling_gpt_oss.eager_attention_forward(
        module, *(t.transpose(0, 1)[None] for t in (q, k, v)), additive, D**-0.5
    )
    got = attention.prefill_attention(q, k, v, n, D**-0.5, window, module.sinks)
    assert torch.allclose(got, want[0], rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "n,ctx_len,window", [(49, 1500, 0), (640, 2000, 0), (300, 300, 0), (7, 30, 40)]
)
def test_later_chunks_take_the_flash_kernel_in_bf16(n, ctx_len, window, monkeypatch):
    """A chunk after a cached prefix, in BF16 with GQA: the bottom-right causal bias (flash)
    gives the explicit softmax's answer, and no [n, ctx_len] mask is built."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator().manual_seed(n + ctx_len)
    H, KVH, D = 32, 4, 128
    q = torch.randn((n, H, D), generator=g)
    k, v = torch.randn((ctx_len, KVH, D), generator=g), torch.randn((ctx_len, KVH, D), generator=g)
    on = [t.to("cuda", torch.bfloat16) for t in (q, k, v)]
    assert attention._flash_lower_right(on[0])
    monkeypatch.setattr(attention, "_prefill_mask", lambda *a: pytest.fail("a mask was built"))
    got = attention.prefill_attention(*on, ctx_len, D**-0.5, window)
    qpos, kpos = torch.arange(ctx_len - n, ctx_len), torch.arange(ctx_len)
    want = explicit(*(t.float().cpu() for t in on), qpos, kpos, D**-0.5, window)
    assert close(got, want, torch.bfloat16)
