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


def _pool_and_host(device: str, variant: str, seed: int, slots: int, experts_n: int):
    """(generator, spec, slot pool, host banks, x [3, 200]) of a 200-wide, 77-row expert
    kind: a pool of `slots` slots and `experts_n` experts in host memory."""
    g = torch.Generator(device=device).manual_seed(seed)
    spec = experts.spec(variant, 200, 77)
    pool = experts.banks(slots, spec, torch.float32, g, device=device)
    banks = experts.banks(experts_n, spec, torch.float32, g, device=device)
    return g, spec, pool, banks, torch.randn(3, 200, device=device, generator=g)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", list(experts.VARIANTS))
@pytest.mark.parametrize("rows", [0, 16, 40, 77])
def test_routes_split_by_rows_read_their_first_rows_from_the_host(device, variant, rows):
    """Routes left out of the pool (slot -1) with HostRows: their experts' first `rows`
    intermediate rows, read from the host banks, without the down bias (the CPU's part)."""
    T, k, S, E = 3, 4, 7, 5
    g, spec, pool, banks, x = _pool_and_host(device, variant, rows + len(variant), S, E)
    slots = torch.stack([torch.randperm(S, device=device, generator=g)[:k] for _ in range(T)])
    ids = torch.randint(0, E, (T, k), device=device, generator=g)
    slots[0, 0] = slots[2, 3] = slots[2, 1] = -1  # three routes split by their rows
    w = torch.rand(T, k, device=device, generator=g)
    rows_t = torch.tensor([rows], dtype=torch.int32, device=device)
    host = moe_gpu.HostRows(banks, ids, rows_t)
    out = moe_gpu._triton_small(x, slots, w, pool, spec, host)
    keep = slots >= 0
    ref = reference.moe_experts(
        x, torch.where(keep, slots, 0), torch.where(keep, w, 0.0), pool, spec
    )
    for t, j in (~keep).nonzero().tolist():
        e = int(ids[t, j])
        part = reference.expert_rows({b: v[e] for b, v in banks.items()}, 0, rows, False)
        ref[t] += w[t, j] * reference.expert_ffn(x[t : t + 1], part, spec)[0]
    assert float((out - ref).norm() / ref.norm()) <= 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", list(experts.VARIANTS))
@pytest.mark.parametrize("split_rows", [0, 40])
def test_slots_filled_by_the_expert_kernels(device, variant, split_rows):
    """Fill: the routes to an expert the books put in a slot this step read it from the
    host banks (the slot holds NaN until then: no route reads it), and the first of them
    writes it there whole; the other routes read their slots, a route with slot -1 is
    skipped or (with HostRows) computed in part from the host."""
    T, k, S, E = 3, 4, 9, 6
    g, spec, pool, banks, x = _pool_and_host(device, variant, split_rows + len(variant), S, E)
    slots = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7], [1, 5, 8, 0]], device=device)
    ids = torch.randint(0, E, (T, k), device=device, generator=g)
    ids[0, 2] = ids[2, 2] = 4  # expert 4 fills slot 8 at route (0, 2), read again by (2, 2)
    slots[0, 2] = 8
    ids[1, 3] = 1  # expert 1 fills slot 7 alone
    slots[2, 3] = -1  # the CPU's route
    fill = torch.full((T * k,), -1, dtype=torch.int32, device=device)
    fill[2], fill[7] = 8, 7
    expect = {n: t.clone() for n, t in pool.items()}
    for n in pool:
        expect[n][8], expect[n][7] = banks[n][4], banks[n][1]
        pool[n][8], pool[n][7] = float("nan"), float("nan")
    w = torch.rand(T, k, device=device, generator=g)
    rows_t = torch.tensor([split_rows], dtype=torch.int32, device=device)
    host = moe_gpu.HostRows(banks, ids, rows_t) if split_rows else None
    filled = moe_gpu.Fill(banks, ids, fill)
    out = moe_gpu._triton_small(x, slots, w, pool, spec, host, filled)
    for n in pool:
        assert torch.equal(pool[n], expect[n]), n
    keep = slots >= 0
    ref = reference.moe_experts(
        x, torch.where(keep, slots, 0), torch.where(keep, w, 0.0), expect, spec
    )
    if host is not None:
        part = reference.expert_rows({b: v[int(ids[2, 3])] for b, v in banks.items()}, 0, 40, False)
        ref[2] += w[2, 3] * reference.expert_ffn(x[2:3], part, spec)[0]
    assert float((out - ref).norm() / ref.norm()) <= 1e-5


class PoisonedTorch:
    """torch, but every floating tensor from `empty` filled with NaN: a buffer a kernel was
    meant to write whole shows any element it left."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*shape, **kw):
        t = torch.empty(*shape, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("packed", [False, True])
def test_routes_served_elsewhere_leave_zeros_without_a_cleared_buffer(device, packed, monkeypatch):
    """The down kernels write a skipped route's rows of their output as zeros: the buffer is
    not cleared by a launch of its own first (one fewer launch a layer of every step)."""
    import dataclasses

    T, k, H, I, S = 2, 4, 64, 32, 9
    g = torch.Generator().manual_seed(3)
    spec = experts.spec("swiglu", H, I)
    if packed:
        spec = dataclasses.replace(spec, formats=("q8_0", "q8_0"))
        pool = {n: t.to(device) for n, t in experts.packed_banks(S, spec, g).items()}
    else:
        pool = {n: t.to(device) for n, t in experts.banks(S, spec, torch.float32, g).items()}
    x = torch.randn(T, H, generator=g).to(device)
    slots = torch.stack([torch.randperm(S, generator=g)[:k] for _ in range(T)]).to(device)
    slots[0, 0], slots[1, 2] = -1, -1
    w = torch.rand(T, k, generator=g).to(device)
    monkeypatch.setattr(moe_gpu, "torch", PoisonedTorch())
    out = moe_gpu._triton_small(x, slots, w, pool, spec)
    monkeypatch.undo()
    keep = slots >= 0
    ref = reference.moe_experts(
        x, torch.where(keep, slots, 0), torch.where(keep, w, 0.0), pool, spec
    )
    assert not out.isnan().any()
    assert float((out.float() - ref.float()).norm() / ref.float().norm()) <= 1e-5
