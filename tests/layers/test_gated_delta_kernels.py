"""The Gated DeltaNet kernels (conv step, recurrent step, gated RMSNorm, chunked prefill)
against the torch code they replace: on the CPU by Triton's interpreter (fp32), and on a
GPU through the layer math's own entry points (fp32 and bf16)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from freetoken.layers import fused
from freetoken.layers import gated_delta as gd

INTERPRET = (
    os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
)
interpreter = pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and triton")

# (key heads, value heads, key dim, value dim): shared key heads, and dims below a block
HEADS = [(2, 4, 16, 32), (1, 1, 32, 8), (2, 2, 128, 128)]


def rel(a, b):
    return float((a - b).float().norm() / b.float().norm())


def decode_inputs(B, HK, HV, Dk, Dv, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    C = 2 * HK * Dk + HV * Dv
    qkv = torch.randn((B, C), generator=g)
    a, b = torch.randn((B, HV), generator=g), torch.randn((B, HV), generator=g)
    A_log, dt_bias = torch.rand(HV, generator=g) - 0.5, torch.rand(HV, generator=g)
    state = torch.randn((B + 2, HV, Dk, Dv), generator=g)
    slots = torch.randperm(B + 2, generator=g)[:B]
    cast = [t.to(dtype).to(device) for t in (qkv, a, b, A_log, dt_bias)]
    return (*cast, state.to(device), slots.to(device))


def prefill_inputs(T, HK, HV, Dk, Dv, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn((T, 2 * HK * Dk + HV * Dv), generator=g).to(dtype).to(device)
    q, k, v = qkv.split([HK * Dk, HK * Dk, HV * Dv], dim=-1)  # views, as the layer has them
    q, k, v = q.view(T, HK, Dk), k.view(T, HK, Dk), v.view(T, HV, Dv)
    a, b = torch.randn((T, HV), generator=g), torch.randn((T, HV), generator=g)
    decay, beta = gd.gates(a, b, torch.rand(HV, generator=g) - 0.5, torch.rand(HV, generator=g))
    state = torch.randn((HV, Dk, Dv), generator=g)
    return q, k, v, decay.to(device), beta.to(device), state.to(device)


def conv_inputs(B, C, K, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((B, C), generator=g)
    w = torch.randn((C, K), generator=g)
    pool = torch.randn((B + 1, C, K - 1), generator=g)
    slots = torch.arange(B, 0, -1)
    return x.to(dtype).to(device), w.to(dtype).to(device), pool.to(dtype).to(device), slots


def unfused(fn, *args):
    with fused.disabled():
        return fn(*args)


@interpreter
@pytest.mark.parametrize("heads", HEADS)
def test_decode_kernels_in_the_interpreter(heads):
    HK, HV, Dk, Dv = heads
    qkv, a, b, A_log, dt_bias, state, slots = decode_inputs(3, *heads, torch.float32, "cpu")
    want_state = state.clone()
    want = unfused(gd.decode_rule, qkv, a, b, A_log, dt_bias, want_state, slots, HK)
    got = gd._decode_rule_fused(qkv, a, b, A_log, dt_bias, state, slots, HK)
    assert rel(got, want) < 1e-5 and rel(state, want_state) < 1e-5
    z = torch.randn(got.shape)
    w = torch.rand(Dv) + 0.5
    want_norm = unfused(gd.gated_rms_norm, got, z, w, 1e-6)
    assert rel(gd._gated_rms_norm_fused(got, z, w, 1e-6), want_norm) < 1e-5


@interpreter
@pytest.mark.parametrize("C,K", [(96, 4), (300, 4), (64, 2)])
def test_conv_step_kernel_in_the_interpreter(C, K):
    x, w, pool, slots = conv_inputs(3, C, K, torch.float32, "cpu")
    want_pool = pool.clone()
    want = unfused(gd.conv1d_step, x, w, want_pool, slots)
    got = gd._conv1d_step_fused(x, w, pool, slots)
    assert torch.allclose(got, want, atol=1e-5) and torch.equal(pool, want_pool)


@interpreter
@pytest.mark.parametrize("T", [1, 40, 64, 150])
@pytest.mark.parametrize("heads", HEADS[:2])
def test_chunk_kernels_in_the_interpreter(T, heads):
    q, k, v, decay, beta, state = prefill_inputs(T, *heads, torch.float32, "cpu")
    want_o, want_s = unfused(gd.chunk_rule, q, k, v, decay, beta, state)
    o, s = gd._chunk_rule_fused(q, k, v, decay, beta, state, 64)
    assert rel(o, want_o) < 1e-5 and rel(s, want_s) < 1e-5


def _tol(dtype):
    return 1e-5 if dtype == torch.float32 else 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", HEADS)
def test_kernels_match_the_torch_code_on_a_gpu(heads, dtype):
    HK, HV, Dk, Dv = heads
    qkv, a, b, A_log, dt_bias, state, slots = decode_inputs(5, *heads, dtype, "cuda")
    want_state = state.clone()
    want = unfused(gd.decode_rule, qkv, a, b, A_log, dt_bias, want_state, slots, HK)
    got = gd.decode_rule(qkv, a, b, A_log, dt_bias, state, slots, HK)
    assert rel(got, want) < _tol(dtype) and rel(state, want_state) < _tol(dtype)
    z = torch.randn(got.shape, device="cuda", dtype=dtype)
    w = (torch.rand(Dv, device="cuda") + 0.5).to(dtype)
    want_norm = unfused(gd.gated_rms_norm, got, z, w, 1e-6)
    assert rel(gd.gated_rms_norm(got, z, w, 1e-6), want_norm) < _tol(dtype)
    x, cw, pool, cslots = conv_inputs(5, 2 * HK * Dk + HV * Dv, 4, dtype, "cuda")
    cslots = cslots.cuda()
    want_pool = pool.clone()
    want = unfused(gd.conv1d_step, x, cw, want_pool, cslots)
    assert rel(gd.conv1d_step(x, cw, pool, cslots), want) < _tol(dtype)
    assert rel(pool, want_pool) < _tol(dtype)
    for T in (1, 100, 777):
        q, k, v, decay, beta, s0 = prefill_inputs(T, *heads, dtype, "cuda")
        want_o, want_s = unfused(gd.chunk_rule, q, k, v, decay, beta, s0)
        o, s = gd.chunk_rule(q, k, v, decay, beta, s0)
        assert rel(o, want_o) < _tol(dtype) and rel(s, want_s) < _tol(dtype), T
