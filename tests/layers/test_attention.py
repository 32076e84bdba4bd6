"""Decode attention read from the paged pool in place, and the KV write, against the torch
code they replace (gather the padded contexts, masked SDPA; indexed stores): on a GPU
through the layer's own entry points, and on the CPU by Triton's interpreter. Sliding
windows and sinks are checked in test_attention_options.py."""

import importlib.util
import os

import pytest
import torch

from freetoken.layers import attention, fused
from freetoken.layers.context import DecodeView

PAGE = 16
# sequences' lengths, padded context (1 split up to 256 positions, more beyond), heads, KV heads,
# head dim
CASES = [((1, 37, 64), 64, 8, 2, 64), ((5, 300, 1024), 1024, 32, 4, 128), ((200,), 256, 4, 4, 32)]


def setup(lens, max_ctx, H, KVH, D, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, P = len(lens), max_ctx // PAGE
    pages = B * P + 3
    k_pool = torch.randn((pages * PAGE, KVH, D), generator=g).to(dtype)
    v_pool = torch.randn((pages * PAGE, KVH, D), generator=g).to(dtype)
    table = torch.randperm(pages, generator=g)[: B * P].view(
        B, P
    )  # pages scattered through the pool
    q = torch.randn((B, H, D), generator=g).to(dtype)
    view = DecodeView(
        block_table=table.to(device), lens=torch.tensor(lens).to(device), page_size=PAGE
    )
    return q.to(device), k_pool.to(device), v_pool.to(device), view


def reference(q, k_pool, v_pool, view, scale):
    with fused.disabled():
        view.derive()
        return attention.decode_attention(q, k_pool, v_pool, view, scale)


def close(a, b, dtype):
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    return a.dtype == b.dtype and a.shape == b.shape and torch.allclose(a.float(), b.float(), **tol)


def kv_case(dtype, device):
    g = torch.Generator().manual_seed(1)
    k, v = (torch.randn((5, 4, 32), generator=g).to(dtype).to(device) for _ in range(2))
    slots = torch.tensor([9, 0, 31, 4, 17]).to(device)
    return k, v, slots, torch.zeros((40, 4, 32), dtype=dtype, device=device)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens,max_ctx,H,KVH,D", CASES)
def test_fused_decode_attention_matches_the_torch_code_on_a_gpu(lens, max_ctx, H, KVH, D, dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    q, k_pool, v_pool, view = setup(lens, max_ctx, H, KVH, D, dtype, "cuda")
    got = attention.decode_attention(q, k_pool, v_pool, view, D**-0.5)
    assert close(got, reference(q, k_pool, v_pool, view, D**-0.5), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_kv_write_matches_indexed_stores_on_a_gpu(dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    k, v, slots, pool = kv_case(dtype, "cuda")
    k_pool, v_pool, k_ref, v_ref = pool.clone(), pool.clone(), pool.clone(), pool.clone()
    attention.store_kv(k, v, slots, k_pool, v_pool)
    with fused.disabled():
        attention.store_kv(k, v, slots, k_ref, v_ref)
    assert torch.equal(k_pool, k_ref) and torch.equal(v_pool, v_ref)


INTERPRET = (
    os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
)


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and triton")
@pytest.mark.parametrize("lens,max_ctx,H,KVH,D", CASES)
def test_kernels_in_the_interpreter(lens, max_ctx, H, KVH, D):
    from freetoken.kernels.triton import attention as kernels

    q, k_pool, v_pool, view = setup(lens, max_ctx, H, KVH, D, torch.float32, "cpu")
    want = reference(q, k_pool, v_pool, view, D**-0.5)
    assert close(attention._decode_fused(q, k_pool, v_pool, view, D**-0.5), want, torch.float32)
    k, v, slots, pool = kv_case(torch.float32, "cpu")
    k_pool, v_pool = pool.clone(), pool.clone()
    kernels.store_kv_kernel[(5,)](k, v, slots, k_pool, v_pool, W=128, BLOCK=128)
    assert torch.equal(k_pool[slots], k) and torch.equal(v_pool[slots], v)
