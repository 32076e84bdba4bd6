"""The gated delta rule's torch code against transformers' (its chunked and recurrent torch
forms, the causal conv1d and the gated RMSNorm), fp32: the chunked form, the recurrent
step and the conv step agree with each other and with the reference, from any state."""

from __future__ import annotations

import pytest
import torch

from freetoken.layers import fused
from freetoken.layers import gated_delta as gd

tf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")

# tokens, key heads, value heads, key dim, value dim
SHAPES = [(1, 2, 2, 16, 16), (37, 2, 4, 16, 32), (130, 1, 2, 32, 16)]


def inputs(T, HK, HV, Dk, Dv, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn((T, HK, Dk), generator=g)
    k = torch.randn((T, HK, Dk), generator=g)
    v = torch.randn((T, HV, Dv), generator=g)
    a, b = torch.randn((T, HV), generator=g), torch.randn((T, HV), generator=g)
    A_log = torch.rand(HV, generator=g) * 2 - 1
    dt_bias = torch.rand(HV, generator=g)
    decay, beta = gd.gates(a, b, A_log, dt_bias)
    state = torch.randn((HV, Dk, Dv), generator=g) * 0.5
    return [t.to(device) for t in (q, k, v, decay, beta, state)]


def rel(a, b):
    return float((a - b).norm() / b.norm())


def reference(q, k, v, decay, beta, state, recurrent=False):
    fn = tf.torch_recurrent_gated_delta_rule if recurrent else tf.torch_chunk_gated_delta_rule
    o, s = fn(
        q[None],
        k[None],
        v[None],
        g=decay[None],
        beta=beta[None],
        initial_state=state[None],
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    return o[0], s[0]


@pytest.mark.parametrize("shape", SHAPES)
def test_chunked_rule_matches_transformers(shape):
    q, k, v, decay, beta, state = inputs(*shape)
    with fused.disabled():
        o, s = gd.chunk_rule(q, k, v, decay, beta, state)
    for recurrent in (False, True):
        want_o, want_s = reference(q, k, v, decay, beta, state, recurrent)
        assert rel(o, want_o) < 1e-5 and rel(s, want_s) < 1e-5


@pytest.mark.parametrize("shape", SHAPES)
def test_recurrent_steps_match_the_chunked_rule(shape):
    """Token by token through a pool of three slots (the sequence in the middle one)."""
    q, k, v, decay, beta, state = inputs(*shape)
    with fused.disabled():
        want_o, want_s = gd.chunk_rule(q, k, v, decay, beta, state, chunk=16)
        pool = torch.zeros((3, *state.shape))
        pool[1] = state
        slots = torch.tensor([1])
        rows = [
            gd.recurrent_step(q[t : t + 1], k[t : t + 1], v[t : t + 1], decay[t : t + 1],
                              beta[t : t + 1], pool, slots)
            for t in range(q.shape[0])
        ]  # fmt: skip
    assert rel(torch.cat(rows), want_o) < 1e-5 and rel(pool[1], want_s) < 1e-5
    assert not pool[0].any() and not pool[2].any()


def test_chunks_continue_from_the_state_they_leave():
    q, k, v, decay, beta, state = inputs(100, 2, 4, 16, 16, seed=3)
    with fused.disabled():
        want_o, want_s = gd.chunk_rule(q, k, v, decay, beta, state)
        o1, s1 = gd.chunk_rule(q[:41], k[:41], v[:41], decay[:41], beta[:41], state)
        o2, s2 = gd.chunk_rule(q[41:], k[41:], v[41:], decay[41:], beta[41:], s1)
    assert rel(torch.cat((o1, o2)), want_o) < 1e-5 and rel(s2, want_s) < 1e-5


def test_conv_matches_transformers_and_steps_continue_it():
    g = torch.Generator().manual_seed(1)
    T, C, K = 9, 24, 4
    x = torch.randn((T, C), generator=g)
    w = torch.randn((C, K), generator=g)
    want = tf.causal_conv1d_fn(x.t()[None], w, None, activation="silu")[0].t()
    y, state = gd.causal_conv1d(x[:5], w, torch.zeros(C, K - 1))
    y2, state2 = gd.causal_conv1d(x[5:], w, state)
    assert torch.allclose(torch.cat((y, y2)), want, atol=1e-6)
    pool = torch.zeros((2, C, K - 1))
    pool[1] = state
    with fused.disabled():
        steps = [gd.conv1d_step(x[t : t + 1], w, pool, torch.tensor([1])) for t in range(5, T)]
    assert torch.allclose(torch.cat(steps), want[5:], atol=1e-6)
    assert torch.allclose(pool[1], state2)


def test_gated_norm_matches_transformers():
    g = torch.Generator().manual_seed(2)
    x, z = torch.randn((6, 3, 32), generator=g), torch.randn((6, 3, 32), generator=g)
    ref = tf.Qwen3NextRMSNormGated(32, eps=1e-6)
    with torch.no_grad():
        ref.weight.copy_(1 + 0.1 * torch.randn(32, generator=g))
        want = ref(x.reshape(-1, 32), z.reshape(-1, 32)).reshape(x.shape)
    with fused.disabled():
        assert torch.allclose(gd.gated_rms_norm(x, z, ref.weight, 1e-6), want, atol=1e-6)
