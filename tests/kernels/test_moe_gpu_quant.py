"""The Triton kernels over packed slots (kernels/triton/quant.py, moe_quant.py) against
decode-then-matmul in fp32 (kernels/reference.py): every format, a decode step and a small
batch through the on-the-fly kernels, a prefill chunk through per-expert decoding, slots
wider than their expert (a pool sized for the widest layer's format). In Triton's
interpreter on host tensors, and on a GPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from freetoken import quant
from freetoken.kernels import moe_gpu, reference
from tests.kernels import experts
from tests.kernels.test_moe_gpu import DEVICES

FORMATS = list(quant.FORMATS)


def _pool(fmts, variant, S, seed, device, wide=1, shape=None):
    """A slot pool of packed experts, each slot `wide` times its expert's bytes; experts of
    `shape` (H, I), else the smallest the formats allow."""
    mult = max(experts.ROW_MULTIPLE.get(f, 1) for f in fmts)
    H, I = shape or (mult, mult)
    spec = dataclasses.replace(experts.spec(variant, H, I), formats=fmts)
    g = torch.Generator().manual_seed(seed)
    banks = experts.packed_banks(S, spec, g)
    pool = {}
    for b, t in banks.items():
        if spec.format_of(b):
            slots = torch.zeros(S, t.shape[1], t.shape[2] * wide, dtype=t.dtype)
            slots.view(S, -1)[:, : t[0].numel()] = t.reshape(S, -1)
            t = slots
        pool[b] = t.to(device)
    return spec, pool, g


def _routes(T, k, S, H, g, device, cpu_share=0.0):
    """x, slots and weights for T tokens of k routes each: route (0, 0) and about `cpu_share`
    of the others served by the CPU (slot -1, nothing here), the last one never."""
    x = torch.randn(T, H, generator=g)
    slots = torch.stack([torch.randperm(S, generator=g)[:k] for _ in range(T)])
    last = int(slots[-1, -1])
    slots[torch.rand(T, k, generator=g) < cpu_share] = -1
    slots[0, 0] = -1
    slots[-1, -1] = last
    return x.to(device), slots.to(device), torch.rand(T, k, generator=g).to(device)


def _rel(out, ref) -> float:
    return float((out.float().cpu() - ref.float().cpu()).norm() / ref.float().cpu().norm())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("T", [1, 3])
def test_small_batch_kernels_decode_on_the_fly(device, fmt, T):
    spec, pool, g = _pool((fmt, fmt), "swiglu", 5, quant.get(fmt).code, device, wide=2)
    x, slots, w = _routes(T, 2, 5, spec.hidden, g, device)
    out = moe_gpu._triton_small(x, slots, w, pool, spec)
    ref = reference.moe_experts(x, slots, w, pool, spec)
    assert _rel(out, ref) <= 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "fmts", [("q4_k", "q6_k"), ("mxfp4", "mxfp4"), ("q8_0", ""), ("nvfp4", "q4_k")]
)
def test_mixed_formats_biases_and_float_banks(device, fmts):
    variant = "clamped+bias" if fmts[0] == "mxfp4" else "swiglu+bias"
    spec, pool, g = _pool(fmts, variant, 4, 11, device)
    x, slots, w = _routes(2, 2, 4, spec.hidden, g, device)
    out = moe_gpu._triton_small(x, slots, w, pool, spec)
    assert _rel(out, reference.moe_experts(x, slots, w, pool, spec)) <= 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["q4_k", "mxfp4", "nvfp4"])
def test_clamped_silu_on_packed_slots(device, fmt):
    """DeepSeek-V4's experts (SwiGLU of clamped inputs) packed, the limit lowered so that the
    clamp is reached, which the unclamped form shows by differing."""
    spec, pool, g = _pool((fmt, fmt), "silu-clamped", 4, 13, device, wide=2)
    spec = dataclasses.replace(spec, limit=0.5)
    x, slots, w = _routes(3, 2, 4, spec.hidden, g, device)
    ref = reference.moe_experts(x, slots, w, pool, spec)
    plain = reference.moe_experts(x, slots, w, pool, dataclasses.replace(spec, activation="silu"))
    assert _rel(plain, ref) > 0.05
    assert _rel(moe_gpu._triton_small(x, slots, w, pool, spec), ref) <= 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_prefill_decodes_each_expert_with_triton(device, fmt):
    spec, pool, _ = _pool((fmt, fmt), "swiglu", 3, 5, device, wide=2)
    for slot in range(3):
        got = moe_gpu.triton_expert_weights(pool, slot, spec, torch.float32)
        want = reference.expert_weights(pool, slot, spec, torch.float32)
        assert all(torch.equal(got[b].cpu(), want[b].cpu()) for b in want)


@pytest.mark.parametrize("device", DEVICES)
def test_nvfp4_every_scale_code_decodes_as_the_reference(device):
    """Every e4m3 group scale (subnormal, negative) and e2m1 code: the prefill decoder's
    weights bit for bit the reference's, the small-batch kernels within fp32 rounding."""
    spec, pool, g = _pool(("nvfp4", "nvfp4"), "swiglu", 3, 9, device, shape=(256, 256))
    for b in ("gate_up", "down"):
        pool[b] = experts.random_nvfp4((3, *spec.rows()[b]), g).to(device)
    for slot in range(3):
        got = moe_gpu.triton_expert_weights(pool, slot, spec, torch.float32)
        want = reference.expert_weights(pool, slot, spec, torch.float32)
        assert all(torch.equal(got[b].cpu(), want[b].cpu()) for b in want)
    x, slots, w = _routes(2, 2, 3, spec.hidden, g, device)
    out = moe_gpu._triton_small(x, slots, w, pool, spec)
    assert _rel(out, reference.moe_experts(x, slots, w, pool, spec)) <= 1e-5


# expert shapes (H, I) spanning several 256-weight steps, and for 32-weight blocks a step
# cut short by the row's end and row counts that 64-row tiles do not divide; each case with
# its model's kind of expert (gpt-oss's biased clamped MXFP4, DeepSeek-V4's clamped Q4_K)
STEPPED = [
    (("q8_0", "q8_0"), (288, 96), "swiglu+bias"),
    (("q4_0", "q4_0"), (288, 96), "swiglu"),
    (("mxfp4", "mxfp4"), (288, 96), "clamped+bias"),
    (("q4_k", "q6_k"), (512, 256), "silu-clamped"),
    (("q5_k", "q5_k"), (512, 256), "swiglu+bias"),
    (("q6_k", "q6_k"), (512, 256), "swiglu"),
    (("fp8_e4m3", "fp8_e4m3"), (384, 128), "swiglu"),
    (("nvfp4", "nvfp4"), (384, 128), "swiglu+bias"),
    (("q8_0", ""), (288, 96), "swiglu+bias"),  # float down rows: a float step cut short
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmts,shape,variant", STEPPED)
def test_steps_tails_and_row_tiles(device, fmts, shape, variant):
    """Rows of several steps (and a last step cut short), tiles of 64 rows that the rows do
    not fill, routes left to the CPU: the small-batch kernels against decode-then-matmul,
    and the prefill decoder's every weight against the reference's."""
    spec, pool, g = _pool(fmts, variant, 3, 7, device, wide=2, shape=shape)
    if variant == "silu-clamped":
        spec = dataclasses.replace(spec, limit=0.5)
    x, slots, w = _routes(2, 2, 3, spec.hidden, g, device, cpu_share=0.3)
    out = moe_gpu._triton_small_packed(x, slots, w, pool, spec, rows=(64, 64))
    assert _rel(out, reference.moe_experts(x, slots, w, pool, spec)) <= 1e-5
    got = moe_gpu.triton_expert_weights(pool, 1, spec, torch.float32)
    want = reference.expert_weights(pool, 1, spec, torch.float32)
    assert all(torch.equal(got[b].cpu(), want[b].cpu()) for b in want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["q4_k", "mxfp4"])
@pytest.mark.parametrize("T,k", [(1, 1), (1, 8), (8, 2)])
def test_batch_sizes_and_top_k(device, fmt, T, k):
    """Decode batches up to 8 tokens and from 1 to 8 routes per token: each route reads its
    own token's x, and tokens may share an expert."""
    S = 9
    spec, pool, g = _pool((fmt, fmt), "swiglu", S, T * 10 + k, device, shape=(256, 256))
    x, slots, w = _routes(T, k, S, spec.hidden, g, device, cpu_share=0.25 if T * k > 1 else 0)
    if T > 1:  # the first token's last expert, for the last token too
        slots[-1, 0] = slots[0, -1]
    out = moe_gpu._triton_small_packed(x, slots, w, pool, spec, rows=(64, 64))
    assert _rel(out, reference.moe_experts(x, slots, w, pool, spec)) <= 1e-5


# rows copied as int32 words (q4_k's 288 bytes), int16 (q6_k's 210, q8_0's 306) and bytes
# (mxfp4's 153 and 51), a float down among packed gate_up rows, row tiles the rows cut short
FILLED = [
    (("q4_k", "q6_k"), (512, 256), "swiglu"),
    (("mxfp4", "mxfp4"), (288, 96), "clamped+bias"),
    (("q8_0", ""), (288, 96), "swiglu+bias"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmts,shape,variant", FILLED)
def test_slots_filled_by_the_packed_kernels(device, fmts, shape, variant):
    """Fill over packed slots twice as wide as their experts: the routes to an expert put in
    a slot this step read it from the host banks (the slot holds poison until then), the
    first of them copies its bytes to the slot's first bytes and reads them there; the rest
    of the slot is left as it was, the other routes read their slots."""
    T, k, S, E = 3, 2, 5, 4
    spec, pool, g = _pool(fmts, variant, S, 17, device, wide=2, shape=shape)
    host = {n: t.to(device) for n, t in experts.packed_banks(E, spec, g).items()}
    assert all(moe_gpu._fills(host[n], pool[n], bool(spec.format_of(n))) for n in pool), (
        "host banks the kernels can copy"
    )
    x, _, w = _routes(T, k, S, spec.hidden, g, device)
    slots = torch.tensor([[0, 3], [3, 1], [4, 2]], device=device)
    ids = torch.tensor([[1, 2], [2, 0], [3, 1]], device=device)  # expert 2 in slot 3, 3 in 4
    fill = torch.tensor([-1, 3, -1, -1, 4, -1], dtype=torch.int32, device=device)
    for t in pool.values():
        t[3:5] = float("nan") if t.is_floating_point() else 255
    expect = {n: t.clone() for n, t in pool.items()}
    for n, t in expect.items():
        width = host[n][0].numel()
        for slot, e in ((3, 2), (4, 3)):
            t.view(S, -1)[slot, :width] = host[n][e].reshape(-1)
    out = moe_gpu._triton_small_packed(
        x, slots, w, pool, spec, rows=(64, 64), fill=moe_gpu.Fill(host, ids, fill)
    )
    for n in pool:
        assert torch.equal(pool[n], expect[n]), n
    assert _rel(out, reference.moe_experts(x, slots, w, expect, spec)) <= 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_pools_off_four_byte_alignment_decode_in_torch(device):
    """The kernels read scales as int16/int32 words: a pool whose slots do not start 4-byte
    aligned is refused by the check and served by the plain-torch decoding instead."""
    spec, pool, g = _pool(("q4_k", "q4_k"), "swiglu", 3, 3, device)
    assert moe_gpu.slots_aligned(pool, spec)
    shifted = {}
    for b, t in pool.items():  # the same bytes two bytes into their storage
        raw = torch.zeros(t.numel() + 2, dtype=t.dtype, device=device)
        raw[2:] = t.reshape(-1)
        shifted[b] = raw[2:].view(t.shape)
    assert not moe_gpu.slots_aligned(shifted, spec)
    x, slots, w = _routes(2, 2, 3, spec.hidden, g, device)
    out = moe_gpu.experts_from_slots(x, slots, w, shifted, spec)
    assert _rel(out, reference.moe_experts(x, slots, w, pool, spec)) <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize(
    "fmt,variant",
    [
        ("q4_k", "swiglu"),
        ("mxfp4", "swiglu"),
        ("fp8_e4m3", "swiglu"),
        ("nvfp4", "swiglu"),
        ("q4_k", "silu-clamped"),
    ],
)
def test_prefill_chunk_matches_in_bf16(fmt, variant):
    """A chunk of 40 tokens (the grouped path) in bf16 against the fp32 definition; DeepSeek-
    V4's clamped experts with a limit the chunk reaches."""
    spec, pool, g = _pool((fmt, fmt), variant, 6, 2, "cuda", wide=2)
    if variant == "silu-clamped":
        spec = dataclasses.replace(spec, limit=0.5)
    x, slots, w = _routes(40, 3, 6, spec.hidden, g, "cuda")
    ref = reference.moe_experts(x, slots, w, pool, spec)
    out = moe_gpu.experts_from_slots(x.bfloat16(), slots, w, pool, spec)
    assert _rel(out, ref) <= 2e-2


@pytest.mark.parametrize("device", DEVICES)
def test_fetch_fills_the_first_bytes_of_wider_slots(device):
    """Fetching packed experts into slots sized for a wider format (the fetch kernel, run by
    Triton's interpreter on the CPU)."""
    from freetoken.kernels.triton import fetch

    g = torch.Generator().manual_seed(0)
    bank = torch.randint(0, 256, (6, 4, 34), generator=g, dtype=torch.uint8).to(device)
    pool = torch.zeros(5, 4, 50, dtype=torch.uint8, device=device)
    experts_ = torch.tensor([3, 1, 4], dtype=torch.int32, device=device)
    slots = torch.tensor([2, -1, 0], dtype=torch.int32, device=device)
    if device == "cpu":  # the kernel itself: fetch_experts copies without it on the CPU
        # blocks of 64 of a 136-byte expert: three programs, the last one partly filled; a
        # grid of bank a's programs alone copies one bank (bank b is never reached)
        args = (bank, pool, 4 * 34, 4 * 50, 3, bank, pool, 4 * 34, 4 * 50, experts_, slots, 3)
        fetch.fetch_pair_kernel[(3,)](*args, BLOCK=64, ROUTES=4)
    else:
        moe_gpu.fetch_experts(bank, pool, experts_, slots)
    flat = pool.view(5, -1)
    assert torch.equal(flat[2, :136], bank[3].reshape(-1)) and not flat[2, 136:].any()
    assert torch.equal(flat[0, :136], bank[4].reshape(-1))
    assert not flat[[1, 3, 4]].any()
    cpu_pool = torch.zeros(5, 4, 50, dtype=torch.uint8)
    moe_gpu.fetch_experts(bank.cpu(), cpu_pool, experts_.cpu(), slots.cpu())
    assert torch.equal(cpu_pool, pool.cpu())


@pytest.mark.parametrize("device", DEVICES)
def test_two_banks_in_one_launch_fill_their_own_slots(device):
    """A layer's two banks (here bf16 rows and wider packed slots) fetched by one launch of
    the pair kernel: each bank's programs copy only their bank (run by Triton's interpreter on
    the CPU), as two separate fetches would. The experts as a router gives them (int64), as a
    step passes them."""
    from freetoken.kernels.triton import fetch

    g = torch.Generator().manual_seed(1)
    a = torch.randn((6, 3, 40), generator=g).bfloat16().to(device)
    b = torch.randint(0, 256, (6, 4, 34), generator=g, dtype=torch.uint8).to(device)
    pool_a = torch.zeros(5, 3, 40, dtype=torch.bfloat16, device=device)
    pool_b = torch.zeros(5, 4, 50, dtype=torch.uint8, device=device)
    experts_ = torch.tensor([3, 1, 4, 5], dtype=torch.int64, device=device)
    slots = torch.tensor([2, -1, 0, 4], dtype=torch.int32, device=device)
    if device == "cpu":  # blocks of 64: two programs of bank a (120), three of bank b (136)
        args = (a, pool_a, 120, 120, 2, b, pool_b, 136, 200, experts_, slots, 4)
        fetch.fetch_pair_kernel[(5,)](*args, BLOCK=64, ROUTES=4)
    else:
        moe_gpu.fetch_banks([(a, pool_a), (b, pool_b)], experts_, slots)
    want_a, want_b = torch.zeros_like(pool_a).cpu(), torch.zeros_like(pool_b).cpu()
    for src, want in ((a, want_a), (b, want_b)):
        moe_gpu.fetch_experts(src.cpu(), want, experts_.cpu(), slots.cpu())
    assert want_a.any() and torch.equal(pool_a.cpu(), want_a)
    assert want_b.any() and torch.equal(pool_b.cpu(), want_b)
