"""The one-kernel router (softmax, top-k, renormalisation, cast) against the torch code it
replaces: on a GPU through TopKRouter itself, and on the CPU by Triton's interpreter."""

import importlib.util
import os

import pytest
import torch

from freetoken.kernels.triton import block
from freetoken.layers import fused
from freetoken.layers.moe import TopKRouter

CASES = [
    (1, 128, 8, True),
    (5, 128, 8, False),
    (3, 60, 4, True),
    (2, 512, 10, True),
]  # tokens, experts, k, renorm


def router(E, k, renorm, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = TopKRouter(64, E, k, renorm)
    with torch.no_grad():
        r.weight.copy_(torch.randn((E, 64), generator=g))
    x = torch.randn((7, 64), generator=g)
    return r.to(device=device, dtype=dtype), x.to(device=device, dtype=dtype)


def reference(r, x):
    """The torch code's weights, and its ids with ties broken towards the lower expert (bf16
    logits tie often; torch.topk leaves their order open, the kernel takes the lower)."""
    with fused.disabled():
        w, _ = r(x)
        probs = torch.softmax(torch.nn.functional.linear(x, r.weight), dim=-1, dtype=torch.float32)
    ids = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, : r.top_k]
    return w, ids


def check(got, want, dtype):
    (w, ids), (w0, ids0) = got, want
    assert w.dtype == w0.dtype == dtype and ids.dtype == ids0.dtype == torch.int64
    assert torch.equal(ids.cpu(), ids0.cpu())
    tol = dict(rtol=1e-2, atol=1e-3) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    assert torch.allclose(w.float().cpu(), w0.float().cpu(), **tol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,E,k,renorm", CASES)
def test_fused_router_matches_the_torch_code_on_a_gpu(T, E, k, renorm, dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    r, x = router(E, k, renorm, dtype, "cuda")
    check(r(x[:T]), reference(r, x[:T]), dtype)


INTERPRET = (
    os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
)


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and triton")
@pytest.mark.parametrize("T,E,k,renorm", CASES)
def test_router_kernel_in_the_interpreter(T, E, k, renorm):
    from freetoken.kernels.triton import router as kernels

    r, x = router(E, k, renorm, torch.float32, "cpu")
    want = reference(r, x[:T])
    logits = torch.nn.functional.linear(x[:T], r.weight)
    w, ids = torch.empty((T, k)), torch.empty((T, k), dtype=torch.int64)
    kernels.topk_softmax_kernel[(T,)](
        logits, w, ids, E, RENORM=renorm, K=k, BLOCK_E=block(E), BLOCK_K=block(k)
    )
    check((w, ids), want, torch.float32)
