"""The small-batch Triton expert kernels (kernels/moe_gpu.py, kernels/triton/moe_decode.py)
against the plain-torch reference, for every kind of expert (SwiGLU, with biases, gpt-oss's
clamped form with biases): in Triton's interpreter on host tensors, and on a GPU."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from freetoken.kernels import moe_gpu, reference
from tests.kernels import experts

INTERPRET = (
    os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
)
DEVICES = [
    pytest.param("cuda", marks=pytest.mark.gpu),
    pytest.param(
        "cpu", marks=pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and triton")
    ),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", list(experts.VARIANTS))
@pytest.mark.parametrize("shape", [(1, 4, 64, 32, 9), (3, 4, 200, 77, 7)])  # T, k, H, I, slots
def test_small_batch_kernel_matches_reference(device, variant, shape):
    T, k, H, I, S = shape
    g = torch.Generator(device=device).manual_seed(len(variant) + T)
    spec = experts.spec(variant, H, I)
    pool = experts.banks(S, spec, torch.float32, g, device=device)  # unscaled: clamps reached
    x = torch.randn(T, H, device=device, generator=g)
    slots = torch.stack([torch.randperm(S, device=device, generator=g)[:k] for _ in range(T)])
    slots[0, 0] = -1  # a route the CPU serves: nothing here
    w = torch.rand(T, k, device=device, generator=g)
    out = moe_gpu._triton_small(x, slots, w, pool, spec)
    keep = slots >= 0
    ref = reference.moe_experts(
        x, torch.where(keep, slots, 0), torch.where(keep, w, 0.0), pool, spec
    )
    assert float((out - ref).norm() / ref.norm()) <= 1e-5
    if spec.activation != "silu":  # the data does reach the clamp, both sides
        gu = torch.einsum("th,seh->tse", x, pool["gate_up"]) + pool.get("gate_up_bias", 0)
        gate, up = gu.chunk(2, dim=-1)
        assert (gate > spec.limit).any() and (up.abs() > spec.limit).any()
