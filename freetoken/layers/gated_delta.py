"""The math of a Gated DeltaNet layer in plain torch: the short causal convolution with its
state, the gated delta rule (a chunked form for prefill, a recurrent step for decode) and the
gated RMSNorm on the output.

Per value head the layer keeps a state S [Dk, Dv] and, for each token, with q and k
L2-normalised (q also scaled by Dk^-1/2), a decay g <= 0 (log space) and a rate β in (0, 1):

    S ← e^g·S;   S ← S + k ⊗ β·(v − Sᵀk);   o = Sᵀq

Several value heads may share a query/key head (value head h reads key head h // (HV / HK)).

The chunked form is the same recurrence over C tokens at once. With Γ_t the cumulative decay
inside a chunk and S₀ the state entering it, the corrections u_t = β_t(v_t − e^{g_t}S_{t−1}ᵀk_t)
solve a unit lower-triangular system (I + A)U = βV − diag(βe^Γ)K·S₀ with
A[t, s] = β_t·e^{Γ_t−Γ_s}·k_t·k_s (s < t); so U = W_v − W_k·S₀, where W_v and W_k depend
on the chunk alone. Then o_t = e^{Γ_t}S₀ᵀq_t + Σ_{s≤t} e^{Γ_t−Γ_s}(q_t·k_s)u_s, and the
state leaving the chunk is e^{Γ_C}S₀ + Σ_s e^{Γ_C−Γ_s}k_s ⊗ u_s.

The state is kept in fp32 whatever the activations' dtype, as the recurrence accumulates
over the whole sequence. On a GPU the decode step and the chunked prefill run as Triton
kernels (kernels/triton/gated_delta*.py) unless the fused kernels are off; the torch code
here is what they are tested against and what runs everywhere else.

Shapes: T tokens, HK query/key heads of Dk, HV value heads of Dv, C conv channels
(2·HK·Dk + HV·Dv), K the conv kernel width, B sequences of a decode step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from freetoken.kernels.triton import block
from freetoken.layers import fused

CHUNK = 64  # tokens the chunked form takes at once
L2_EPS = 1e-6


def _rows(*xs: torch.Tensor) -> bool:
    """Views the kernels read in place: GPU tensors [T, heads, D] whose heads are packed
    (the split of one projection), any stride between tokens, one dtype."""
    return all(
        fused.ENABLED
        and x.is_cuda
        and x.dtype == xs[0].dtype
        and x.stride(-1) == 1
        and x.stride(-2) == x.shape[-1]
        for x in xs
    )


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def gates(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decay g = −e^{A_log}·softplus(a + dt_bias) and rate β = σ(b), both fp32 [.., HV]."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, torch.sigmoid(b).float()


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's new tokens x [T, C] through the depthwise causal convolution (weight
    [C, K]) and SiLU, continuing from `state` [C, K-1] (its last K-1 inputs, oldest first).
    Returns (y [T, C], the new state)."""
    K = weight.shape[-1]
    full = torch.cat((state.to(x.dtype), x.t()), dim=1)  # [C, K-1+T]
    y = F.conv1d(full[None], weight[:, None, :].to(x.dtype), groups=x.shape[1])[0]
    return F.silu(y).t(), full[:, full.shape[1] - (K - 1) :]


def conv1d_step(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """One token per sequence, x [B, C]: y [B, C], and each sequence's state in the pool
    conv_state [N, C, K-1] at slots [B] moved on by one input, in place."""
    if fused.usable(x, conv_state, weight) and slots.is_contiguous():
        return _conv1d_step_fused(x, weight, conv_state, slots)
    window = torch.cat((conv_state[slots].to(x.dtype), x[:, :, None]), dim=2)  # [B, C, K]
    y = (window.float() * weight.float()).sum(-1)
    conv_state[slots] = window[:, :, 1:].to(conv_state.dtype)
    return F.silu(y).to(x.dtype)


def _heads(q: torch.Tensor, k: torch.Tensor, HV: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [.., HK, Dk] -> fp32 [.., HV, Dk]: normalised, q scaled, shared by value heads."""
    r = HV // q.shape[-2]
    q = l2norm(q.float()) * q.shape[-1] ** -0.5
    k = l2norm(k.float())
    return q.repeat_interleave(r, dim=-2), k.repeat_interleave(r, dim=-2)


def recurrent_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """One token per sequence: q, k [B, HK, Dk], v [B, HV, Dv], g/beta [B, HV]; each
    sequence's state in the pool state [N, HV, Dk, Dv] at slots [B] is updated in place.
    Returns o [B, HV, Dv] in v's dtype."""
    q, k = _heads(q, k, v.shape[1])
    S = state[slots].float() * g.exp()[..., None, None]  # [B, HV, Dk, Dv]
    delta = (v.float() - (S * k[..., None]).sum(-2)) * beta[..., None]
    S = S + k[..., None] * delta[..., None, :]
    state[slots] = S.to(state.dtype)
    return (S * q[..., None]).sum(-2).to(v.dtype)


def decode_rule(
    qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    k_heads: int,
) -> torch.Tensor:
    """A decode step from the conv's output q|k|v [B, C] and the raw gate inputs a, b
    [B, HV]: the gates, the split into heads and `recurrent_step` (one kernel on a GPU)."""
    B = qkv.shape[0]
    HV, Dk, Dv = state.shape[1:]
    if (
        fused.usable(qkv, a, b)
        and fused.usable(A_log, dt_bias)
        and fused.usable(state)
        and slots.is_contiguous()
        and a.stride() == b.stride()
    ):
        return _decode_rule_fused(qkv, a, b, A_log, dt_bias, state, slots, k_heads)
    q, k, v = qkv.split([k_heads * Dk, k_heads * Dk, HV * Dv], dim=-1)
    g, beta = gates(a, b, A_log, dt_bias)
    return recurrent_step(
        q.view(B, k_heads, Dk), k.view(B, k_heads, Dk), v.view(B, HV, Dv), g, beta, state, slots
    )


def chunk_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's tokens: q, k [T, HK, Dk], v [T, HV, Dv], g/beta [T, HV], continuing
    from state [HV, Dk, Dv]. Returns (o [T, HV, Dv] in v's dtype, the new state, fp32)."""
    if _rows(q, k, v) and fused.usable(g, beta, state):
        return _chunk_rule_fused(q, k, v, g, beta, state, chunk)
    T, HV = v.shape[:2]
    q, k = _heads(q, k, HV)
    n = -(-T // chunk)
    pad = n * chunk - T

    def blocks(x: torch.Tensor) -> torch.Tensor:  # [T, HV, ...] -> [HV, n, C, ...]
        x = F.pad(x.float(), (0, 0) * (x.dim() - 2) + (0, 0, 0, pad))
        return x.transpose(0, 1).reshape(HV, n, chunk, *x.shape[2:])

    q, k, v, g, beta = (blocks(x) for x in (q, k, v, g, beta))
    G = g.cumsum(-1)  # [HV, n, C]
    incl = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~incl, float("-inf")).exp()
    A = (beta[..., None] * (k @ k.transpose(-1, -2)) * decay).tril(-1)
    system = A + torch.eye(chunk, device=q.device)
    W_k = torch.linalg.solve_triangular(system, (beta * G.exp())[..., None] * k, upper=False)
    W_v = torch.linalg.solve_triangular(system, beta[..., None] * v, upper=False)
    S = state.float()
    out = torch.empty_like(W_v)
    for i in range(n):
        u = W_v[:, i] - W_k[:, i] @ S  # [HV, C, Dv]
        inter = (q[:, i] * G[:, i, :, None].exp()) @ S
        out[:, i] = inter + ((q[:, i] @ k[:, i].transpose(-1, -2)) * decay[:, i]) @ u
        last = G[:, i, -1]  # [HV]
        tail = (last[:, None] - G[:, i]).exp()[..., None]  # decay from each token to the end
        S = last.exp()[:, None, None] * S + (k[:, i] * tail).transpose(-1, -2) @ u
    o = out.reshape(HV, n * chunk, -1)[:, :T].transpose(0, 1)
    return o.to(v.dtype), S


def gated_rms_norm(
    x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """RMSNorm of each head's output x [.., Dv] (fp32, cast back, then the weight), times
    SiLU of the gate z."""
    if fused.usable(x, z, weight):
        return _gated_rms_norm_fused(x, z, weight, eps)
    dtype = x.dtype
    h = x.float()
    h = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return (h * F.silu(z.float())).to(dtype)


def _conv1d_step_fused(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    from freetoken.kernels.triton import gated_delta as kernels

    (B, C), K = x.shape, weight.shape[-1]
    out = torch.empty_like(x)
    BLOCK_C = 128
    kernels.conv1d_step_kernel[(B, -(-C // BLOCK_C))](
        x, weight, conv_state, slots, out, C, x.stride(0), K=K, KB=block(K), BLOCK_C=BLOCK_C
    )
    return out


def _chunk_rule_fused(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    from freetoken.kernels.triton import gated_delta_chunk as kernels

    T, HK, Dk = q.shape
    HV, Dv = v.shape[1:]
    n = -(-T // chunk)
    f32 = dict(dtype=torch.float32, device=q.device)
    cum = torch.empty((n * chunk, HV), **f32)
    wk, wv = torch.empty((n * chunk, HV, Dk), **f32), torch.empty((n * chunk, HV, Dv), **f32)
    # fp32 activations get fp32 products; others the tensor cores' tf32, as their own dtype
    # would round harder anyway
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    BK, BV = max(16, block(Dk)), max(16, block(Dv))
    kernels.chunk_prepare_kernel[(n, HV)](
        k, v, g, beta, cum, wk, wv, T, k.stride(0), v.stride(0), HK, HV,
        C=chunk, DK=Dk, DV=Dv, BK=BK, BV=BV, PRECISION=precision,
    )  # fmt: skip
    S = state.float().contiguous().clone()
    out = v.new_empty((T, HV, Dv))
    BV_STATE = min(BV, 32)
    kernels.chunk_state_kernel[(HV, -(-Dv // BV_STATE))](
        q, k, cum, wk, wv, S, out, T, n, q.stride(0), k.stride(0), HK, HV, Dk**-0.5,
        C=chunk, DK=Dk, DV=Dv, BK=BK, BV=BV_STATE, PRECISION=precision,
    )  # fmt: skip
    return out, S


def _decode_rule_fused(
    qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    k_heads: int,
) -> torch.Tensor:
    from freetoken.kernels.triton import gated_delta as kernels

    B = qkv.shape[0]
    HV, Dk, Dv = state.shape[1:]
    out = qkv.new_empty((B, HV, Dv))
    BV = min(32, max(16, block(Dv)))
    kernels.recurrent_step_kernel[(B, HV, -(-Dv // BV))](
        qkv, a, b, A_log, dt_bias, state, slots, out, qkv.stride(0), a.stride(0),
        k_heads, HV, Dk**-0.5, DK=Dk, DV=Dv, BK=max(16, block(Dk)), BV=BV,
    )  # fmt: skip
    return out


def _gated_rms_norm_fused(
    x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    from freetoken.kernels.triton import gated_delta as kernels

    out = torch.empty_like(x)
    D = x.shape[-1]
    kernels.gated_rms_norm_kernel[(x.numel() // D,)](x, z, weight, out, D, eps, BLOCK=block(D))
    return out
