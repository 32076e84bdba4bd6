"""The one-kernel RMSNorm and head norm + rotary embedding against the torch code they
replace: on a GPU through the layers' own entry points, and on the CPU by Triton's
interpreter."""

import importlib.util
import os

import pytest
import torch

from freetoken.kernels.triton import block
from freetoken.layers import fused, norm
from freetoken.layers.rope import RotaryEmbedding

SHAPES = [(1, 8, 128), (7, 4, 128), (3, 2, 64)]  # tokens, heads, head dim


def inputs(T, heads, D, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn((T, heads, D), generator=g) * 3).to(dtype).to(device)
    w = (torch.rand(D, generator=g) + 0.5).to(dtype).to(device)
    rope = RotaryEmbedding(D, 1e6).to(device)
    cos, sin = rope(torch.tensor([5, 900, 3, 17, 0, 1, 64][:T], device=device), dtype)
    return x, w, cos, sin


def unfused(fn, *args):
    with fused.disabled():
        return fn(*args)


def reference(x, w, cos, sin, eps=1e-6, zc=False):
    return (
        unfused(norm.rms_norm, x, w, eps, zc),
        unfused(norm.head_norm_rope, x, w, eps, cos, sin, zc),
    )


def close(a, b, dtype):
    # bf16: the sum of squares in another order may move a value by one unit in the last place
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    return a.dtype == b.dtype and torch.allclose(a.float(), b.float(), **tol)


@pytest.mark.gpu
@pytest.mark.parametrize("zc", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_kernels_match_the_torch_code_on_a_gpu(shape, dtype, zc):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x, w, cos, sin = inputs(*shape, dtype, "cuda")
    want_norm, want_rope = reference(x, w, cos, sin, zc=zc)
    assert close(norm.rms_norm(x, w, 1e-6, zc), want_norm, dtype)
    assert close(norm.head_norm_rope(x, w, 1e-6, cos, sin, zc), want_rope, dtype)
    h = x.reshape(shape[0], -1).contiguous()  # a hidden-state row, as the decoder layers norm it
    wh = w.repeat(shape[1])
    assert close(norm.rms_norm(h, wh, 1e-6, zc), unfused(norm.rms_norm, h, wh, 1e-6, zc), dtype)


INTERPRET = (
    os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
)


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and triton")
@pytest.mark.parametrize("zc", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_kernels_in_the_interpreter(shape, zc):
    """fp32 only: the interpreter converts to bf16 by truncating, where a GPU rounds to
    nearest, so bf16 rounding is checked on the GPU above."""
    from freetoken.kernels.triton import norm as kernels

    dtype = torch.float32
    T, heads, D = shape
    x, w, cos, sin = inputs(T, heads, D, dtype, "cpu")
    want_norm, want_rope = reference(x, w, cos, sin, zc=zc)
    out = torch.empty_like(x)
    kernels.rms_norm_kernel[(T * heads,)](x, w, out, D, 1e-6, BLOCK=block(D), ZERO_CENTERED=zc)
    assert close(out, want_norm, dtype)
    out = torch.empty_like(x)
    kernels.head_norm_rope_kernel[(T * heads,)](
        x, w, cos, sin, out, heads, 1e-6, D=D, HALF=D // 2, ZERO_CENTERED=zc
    )
    assert close(out, want_rope, dtype)
