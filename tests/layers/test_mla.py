"""Multi-head latent attention: the absorbed decode (q_nope through W_UK, attention over the
latents, out through W_UV) against the torch code that expands the latents; the Triton kernel
against its torch reference, by Triton's interpreter on the CPU and on a GPU; kv_b_proj whole
and split per head (llama.cpp's attn_k_b / attn_v_b) alike."""

from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch

from freetoken.layers import fused, mla
from freetoken.layers.context import DecodeView, KVStore, SeqSpan, StepContext, step_context
from freetoken.layers.rope_scaling import ScaledRotaryEmbedding

PAGE = 16
INTERPRET = (
    os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
)


def make_layer(seed=0, *, q_lora_rank=24, split=False, r=32, dr=16, heads=4):
    layer = mla.MLAttention(
        0,
        48,
        heads,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=r,
        qk_nope_head_dim=16,
        qk_rope_head_dim=dr,
        v_head_dim=24,
        scale=(16 + dr) ** -0.5 * 1.3,
        split_kv_b=split,
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    return layer.eval()


def split_copy(layer: mla.MLAttention) -> mla.MLAttention:
    """The same layer with kv_b_proj held as llama.cpp splits it."""
    other = make_layer(q_lora_rank=layer.q_lora_rank, split=True, r=layer.r, dr=layer.dr)
    state = {k: v for k, v in layer.state_dict().items() if not k.startswith("kv_b_proj")}
    state["k_b_proj.weight"] = layer.w_uk().transpose(1, 2).contiguous()
    state["v_b_proj.weight"] = layer.w_uv().contiguous()
    other.load_state_dict(state)
    return other


def store(layer, pages=24):
    kv = KVStore()
    kv.k, kv.v = [torch.zeros((pages * PAGE, 1, layer.r + layer.dr))], [None]
    return kv


def prefill(layer, kv, x, pages_of_seq, lens):
    """Each sequence's first lens[b] tokens, in one step (positions 0..len-1)."""
    rope = ScaledRotaryEmbedding(layer.dr, 10000.0).to(x.device)
    spans, slots, positions, start = [], [], [], 0
    for pages, n in zip(pages_of_seq, lens):
        pos = torch.arange(n, device=x.device)
        s = torch.tensor(pages, device=x.device)[pos // PAGE] * PAGE + pos % PAGE
        spans.append(SeqSpan(start, n, n, s))
        slots.append(s)
        positions.append(pos)
        start += n
    positions = torch.cat(positions)
    ctx = StepContext(positions, torch.cat(slots), spans, kv, torch.arange(start, device=x.device))
    with torch.inference_mode(), step_context(ctx):
        return layer(x, rope(positions, x.dtype))


def decode(layer, kv, x, pages_of_seq, lens):
    """One fixed-shape decode step: token lens[b] - 1 of each sequence."""
    rope = ScaledRotaryEmbedding(layer.dr, 10000.0).to(x.device)
    P = max(len(p) for p in pages_of_seq)
    table = torch.tensor([p + [0] * (P - len(p)) for p in pages_of_seq], device=x.device)
    lens_t = torch.tensor(lens, device=x.device)
    pos = lens_t - 1
    slots = table[torch.arange(len(lens), device=x.device), pos // PAGE] * PAGE + pos % PAGE
    view = DecodeView(block_table=table, lens=lens_t, page_size=PAGE)
    view.derive()
    ctx = StepContext(pos, slots, [], kv, torch.arange(len(lens), device=x.device), decode=view)
    with torch.inference_mode(), step_context(ctx):
        return layer(x, rope(pos, x.dtype))


SEQS = ([[3, 7], [0], [11, 2, 5]], [20, 9, 40])  # pages of each sequence, context lengths


def run_both(layer, monkeypatch, absorbed):
    """Prefill every sequence but its last token, then decode that token; the outputs."""
    pages, lens = SEQS
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn((n, 48), generator=g) for n in lens]
    kv = store(layer)
    prefill(layer, kv, torch.cat([x[:-1] for x in xs]), pages, [n - 1 for n in lens])
    if absorbed:
        monkeypatch.setattr(mla, "kernel_usable", lambda *t: True)
        monkeypatch.setattr(mla, "decode_latent_attention", absorbed)
    return decode(layer, kv, torch.stack([x[-1] for x in xs]), pages, lens), kv, xs


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_decode_step_equals_the_prefill_of_the_whole_context(q_lora_rank):
    layer = make_layer(q_lora_rank=q_lora_rank)
    pages, lens = SEQS
    out, _, xs = run_both(layer, None, None)
    for b, x in enumerate(xs):
        full = prefill(layer, store(layer), x, [pages[b]], [lens[b]])
        assert torch.allclose(out[b], full[-1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("split", [False, True])
def test_absorbed_decode_equals_the_expanded_one(split, monkeypatch):
    layer = make_layer(seed=1)
    layer = split_copy(layer) if split else layer
    want, _, _ = run_both(layer, monkeypatch, None)
    got, _, _ = run_both(layer, monkeypatch, mla.latent_attention_reference)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


def test_split_kv_b_equals_the_whole_one():
    layer = make_layer(seed=2)
    a, kv_a, _ = run_both(layer, None, None)
    b, kv_b, _ = run_both(split_copy(layer), None, None)
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    assert torch.allclose(kv_a.k[0], kv_b.k[0])  # the cache holds only the latents


# lengths, padded context (one split up to 256 positions, more beyond), heads, latent, rope
CASES = [((1, 37, 64), 64, 4, 32, 16), ((5, 300, 700), 768, 20, 48, 8), ((200,), 256, 16, 64, 64)]


def kernel_case(lens, max_ctx, H, R, P, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, npages = len(lens), max_ctx // PAGE
    pages = B * npages + 3
    pool = torch.randn((pages * PAGE, 1, R + P), generator=g).to(dtype)
    table = torch.randperm(pages, generator=g)[: B * npages].view(B, npages)
    q = torch.randn((B, H, R), generator=g).to(dtype)
    qp = torch.randn((B, H, P), generator=g).to(dtype)
    view = DecodeView(
        block_table=table.to(device), lens=torch.tensor(lens).to(device), page_size=PAGE
    )
    return q.to(device), qp.to(device), pool.to(device), view


def reference(q, qp, pool, view, scale):
    view.derive()
    return mla.latent_attention_reference(q, qp, pool, view, scale)


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and triton")
@pytest.mark.parametrize("lens,max_ctx,H,R,P", CASES)
def test_kernel_in_the_interpreter(lens, max_ctx, H, R, P):
    q, qp, pool, view = kernel_case(lens, max_ctx, H, R, P, torch.float32, "cpu")
    scale = (R + P) ** -0.5
    got = mla.decode_latent_attention(q, qp, pool, view, scale)
    assert torch.allclose(got, reference(q, qp, pool, view, scale), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and triton")
def test_layer_decode_through_the_kernel_in_the_interpreter(monkeypatch):
    layer = make_layer(seed=3)
    want, _, _ = run_both(layer, monkeypatch, None)
    got, _, _ = run_both(layer, monkeypatch, mla.decode_latent_attention)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens,max_ctx,H,R,P", CASES + [((3, 4000), 4096, 128, 512, 64)])
def test_kernel_matches_the_torch_code_on_a_gpu(lens, max_ctx, H, R, P, dtype):
    q, qp, pool, view = kernel_case(lens, max_ctx, H, R, P, dtype, "cuda")
    scale = (R + P) ** -0.5
    got = mla.decode_latent_attention(q, qp, pool, view, scale)
    want = reference(q, qp, pool, view, scale)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    assert got.dtype == dtype and torch.allclose(got.float(), want.float(), **tol)


@pytest.mark.gpu
def test_layer_decode_on_a_gpu_equals_the_expanded_torch_code():
    layer = make_layer(seed=4).cuda()
    pages, lens = SEQS
    g = torch.Generator().manual_seed(5)
    kv = store(layer)
    kv.k = [kv.k[0].cuda()]
    xs = [torch.randn((n, 48), generator=g).cuda() for n in lens]
    prefill(layer, kv, torch.cat([x[:-1] for x in xs]), pages, [n - 1 for n in lens])
    last = torch.stack([x[-1] for x in xs])
    got = decode(layer, kv, last, pages, lens)
    with fused.disabled():
        want = decode(layer, kv, last, pages, lens)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)
