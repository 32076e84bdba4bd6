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

from freetoken.layers import mla
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


def test_split_kv_b_equals_the_whole_one():
    layer = make_layer(seed=2)
    a, kv_a, _ = run_both(layer, None, None)
    b, kv_b, _ = run_both(split_copy(layer), None, None)
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    assert torch.allclose(kv_a.k[0], kv_b.k[0])  # the cache holds only the latents
