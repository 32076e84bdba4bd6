"""The C++ CPU expert kernel on packed banks (every block format, read in place) against
decode-then-matmul in fp32 (kernels/reference.py), decode and prefill shapes, every tier."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from freetoken import quant
from freetoken.kernels import cpu, reference
from tests.kernels import experts
from tests.kernels.test_cpu_moe import _tiers

FORMATS = list(quant.FORMATS)


def _case(fmts, variant, T, k, E=6, seed=0, dtype=torch.bfloat16):
    """Packed banks (biases and any float bank in `dtype`), activations and routes."""
    mult = max(experts.ROW_MULTIPLE.get(f, 1) for f in fmts)
    spec = experts.spec(variant, 2 * mult, mult)  # H and I differ: a swapped one shows
    spec = dataclasses.replace(spec, formats=fmts)
    g = torch.Generator().manual_seed(seed)
    banks = experts.packed_banks(E, spec, g, dtype)
    x = torch.randn(T, spec.hidden, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=g)
    return spec, banks, x, ids, w


def _run(spec, banks, x, ids, w, isa):
    T, k = ids.shape
    tok = torch.arange(T).repeat_interleave(k)
    return cpu.moe_experts(x, banks, tok, ids.reshape(-1), w.reshape(-1), spec, isa=isa)


@pytest.mark.parametrize("isa", _tiers())
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("T,k", [(1, 2), (5, 3)])  # a decode step, a prefill chunk
def test_packed_banks_match_decode_then_matmul(fmt, isa, T, k):
    spec, banks, x, ids, w = _case((fmt, fmt), "swiglu", T, k, seed=T)
    ref = reference.moe_experts(x, ids, w, banks, spec)
    out = _run(spec, banks, x, ids, w, isa)
    assert float((out - ref).norm() / ref.norm()) <= 1e-5


@pytest.mark.parametrize(
    "fmts", [("q4_k", "q6_k"), ("mxfp4", "mxfp4"), ("q8_0", ""), ("nvfp4", "q4_k")]
)
def test_mixed_formats_and_biases(fmts):
    """gate_up and down in different formats (a Q4_K_M layer), gpt-oss's clamped experts with
    biases on MXFP4 (bf16 biases), and a packed gate_up beside an fp32 down (AVX-512-BF16
    would round h for a bf16 one)."""
    variant = "clamped+bias" if fmts[0] == "mxfp4" else "swiglu+bias"
    dtype = torch.float32 if "" in fmts else torch.bfloat16
    spec, banks, x, ids, w = _case(fmts, variant, 3, 2, seed=7, dtype=dtype)
    ref = reference.moe_experts(x, ids, w, banks, spec)
    out = _run(spec, banks, x, ids, w, None)
    assert float((out - ref).norm() / ref.norm()) <= 1e-5


@pytest.mark.parametrize("isa", _tiers())
def test_nvfp4_every_scale_code_matches_the_reference(isa):
    """Every e4m3 group scale (subnormal, negative) and e2m1 code, through each tier's dot
    product, against decode-then-matmul."""
    ext = cpu.extension()
    if ext is None:
        pytest.skip("no C++ kernel")
    g = torch.Generator().manual_seed(4)
    rows = experts.random_nvfp4((17, 512), g)
    x = torch.randn(512, generator=g)
    ref = reference.dequantize(rows, "nvfp4").double() @ x.double()
    out = ext.quant_matvec(rows, x, quant.get("nvfp4").code, cpu.TIERS.index(isa), False)
    assert float((out.double() - ref).norm() / ref.norm()) <= 1e-6


@pytest.mark.parametrize("isa", _tiers())
def test_fp8_every_code_matches_the_reference(isa):
    """Every e4m3 code but NaN (subnormal, zero, negative, the largest), shuffled into FP8
    rows under random block scales, through each tier's dot product."""
    ext = cpu.extension()
    if ext is None:
        pytest.skip("no C++ kernel")
    g = torch.Generator().manual_seed(5)
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    rows, cols = 6, 512
    out = torch.empty(rows, cols // 128, 132, dtype=torch.uint8)
    for r in range(rows):
        picked = codes[torch.randperm(cols, generator=g) % len(codes)].view(-1, 128)
        out[r, :, 4:] = picked
        scales = torch.rand(cols // 128, generator=g) + 0.5
        out[r, :, :4] = scales.view(torch.uint8).view(-1, 4)
    packed = out.view(rows, -1)
    x = torch.randn(cols, generator=g)
    ref = reference.dequantize(packed, "fp8_e4m3").double() @ x.double()
    got = ext.quant_matvec(packed, x, quant.get("fp8_e4m3").code, cpu.TIERS.index(isa), False)
    assert float((got.double() - ref).norm() / ref.norm()) <= 1e-6


def test_a_wider_row_holds_a_narrower_format():
    """A slot sized for the widest format holds a narrower one from its first byte."""
    spec, banks, x, ids, w = _case(("q4_k", "q4_k"), "swiglu", 2, 2, seed=3)
    wide = {
        b: torch.zeros(t.shape[0], t.shape[1], t.shape[2] * 2, dtype=t.dtype)
        for b, t in banks.items()
    }
    for b, t in banks.items():
        wide[b].view(t.shape[0], -1)[:, : t[0].numel()] = t.reshape(t.shape[0], -1)
    ref = reference.moe_experts(x, ids, w, banks, spec)
    assert float((reference.moe_experts(x, ids, w, wide, spec) - ref).norm() / ref.norm()) == 0
    assert float((_run(spec, wide, x, ids, w, None) - ref).norm() / ref.norm()) <= 1e-5


@pytest.mark.parametrize("fmt", ["q4_k", "mxfp4", "fp8_e4m3", "nvfp4"])
def test_clamped_silu_on_packed_banks(fmt):
    """DeepSeek-V4's experts (SwiGLU of clamped inputs) packed: the limit lowered so that the
    clamp is reached, which the unclamped form shows by differing."""
    spec, banks, x, ids, w = _case((fmt, fmt), "silu-clamped", 4, 2, seed=5)
    spec = dataclasses.replace(spec, limit=0.5)
    ref = reference.moe_experts(x, ids, w, banks, spec)
    plain = reference.moe_experts(x, ids, w, banks, dataclasses.replace(spec, activation="silu"))
    assert float((plain - ref).norm() / ref.norm()) > 0.05
    for isa in _tiers():
        out = _run(spec, banks, x, ids, w, isa)
        assert float((out - ref).norm() / ref.norm()) <= 1e-5


# ---- int8 activations (quant_act.cpp, quant_vnni.cpp): BF16 models' packed banks ----------

# formats without an int8 kernel: a BF16 model's banks in them keep exact activations
EXACT_ONLY = ("fp8_e4m3",)
INT8_FORMATS = [f for f in FORMATS if f not in EXACT_ONLY]
# A dot product's relative error from 8-bit activations with a scale per 32: each code is off
# by at most half its block's step (max|x| / 254), about 0.5% of a Gaussian vector's norm. An
# expert quantizes x and then h: about 1.1% of its output on these random banks, every format.
INT8_TOLERANCE = 2e-2


def _int8_kernel(fmt: str, tier: int = -1) -> bool:
    """Whether rows of `fmt` take int8 activations at `tier` (an index of cpu.TIERS; -1 the
    CPU's best): AVX-512 VNNI's kernels, or AVX2's for the K-quants."""
    ext = cpu.extension()
    return ext is not None and ext.has_int8_kernel(quant.get(fmt).code, tier)


# The int8 kernels' instruction sets: the CPU's best, and AVX2 (quant_avx2.cpp) below it.
INT8_TIERS = [-1, cpu.TIERS.index("avx2")]


def _representable(cols: int, g: torch.Generator) -> torch.Tensor:
    """Activations that int8 codes with a scale per 32 hold exactly: codes in [-127, 127], one
    of each 32 at ±127, times a power of two (so the scale max|x| / 127 is exact)."""
    q = torch.randint(-127, 128, (cols // 32, 32), generator=g)
    q[:, 7] = 127 * (torch.randint(0, 2, (cols // 32,), generator=g) * 2 - 1)
    scale = 2.0 ** torch.randint(-6, 2, (cols // 32, 1), generator=g)
    return (q * scale).reshape(-1).float()


@pytest.mark.parametrize("fmt", EXACT_ONLY)
def test_formats_without_an_int8_kernel_say_so(fmt):
    """moe_experts then gives their banks fp32 activations, whatever the model's dtype."""
    ext = cpu.extension()
    if ext is None:
        pytest.skip("no C++ kernel")
    assert not ext.has_int8_kernel(quant.get(fmt).code)


def test_below_avx512_the_k_quants_take_int8_activations():
    """At the AVX2 tier (CPUs without AVX-512 VNNI), Q4_K, Q5_K and Q6_K rows (most of a
    Q4_K_M or Q5_K_M GGUF's expert bytes), Q8_0, Q4_0 and MXFP4 (gpt-oss's) ones have int8
    kernels; NVFP4 and FP8 keep fp32 activations, and the plain C++ tier has none."""
    ext = cpu.extension()
    if ext is None or ext.cpu_tier() < cpu.TIERS.index("avx2"):
        pytest.skip("needs the C++ kernel on a CPU with AVX2")
    avx2 = cpu.TIERS.index("avx2")
    expected = {"q4_k", "q5_k", "q6_k", "q8_0", "q4_0", "mxfp4"}
    assert {f for f in FORMATS if _int8_kernel(f, avx2)} == expected
    assert not any(_int8_kernel(f, cpu.TIERS.index("scalar")) for f in FORMATS)


def test_nvfp4_int8_kernel_takes_every_scale_code():
    """The int8 kernel converts the e4m3 group scales itself (through fp16's fields): every
    code, subnormal and negative ones too, on activations int8 holds exactly."""
    if not _int8_kernel("nvfp4"):
        pytest.skip("no int8 kernel on this CPU (needs AVX-512 VNNI)")
    g = torch.Generator().manual_seed(5)
    rows = experts.random_nvfp4((17, 512), g)
    x = _representable(512, g)
    ref = reference.dequantize(rows, "nvfp4").double() @ x.double()
    out = cpu.extension().quant_matvec(rows, x, quant.get("nvfp4").code, -1, True)
    assert float((out.double() - ref).norm() / ref.norm()) <= 1e-6


@pytest.mark.parametrize("tier", INT8_TIERS)
@pytest.mark.parametrize("fmt", INT8_FORMATS)
@pytest.mark.parametrize("blocks", [1, 3, 5, 9, 12])
def test_int8_kernels_are_exact_where_the_activations_are(fmt, blocks, tier):
    """On activations the quantization keeps exactly, the int8 kernels' dot products are
    decode-then-matmul's up to fp32 rounding: every code, scale and order is right. Odd row
    counts past a tile of 16 rows, and rows of a few blocks (32-weight formats go four blocks a
    step, then singly; K-quant rows of an odd number go two rows at once)."""
    if not _int8_kernel(fmt, tier):
        pytest.skip("no int8 kernel for this format at this tier on this CPU")
    cols = blocks * quant.get(fmt).block
    g = torch.Generator().manual_seed(blocks)
    rows = experts.pack(torch.randn(37, cols, generator=g) / cols**0.5, fmt)
    x = _representable(cols, g)
    ref = reference.dequantize(rows, fmt).double() @ x.double()
    out = cpu.extension().quant_matvec(rows, x, quant.get(fmt).code, tier, True)
    assert float((out.double() - ref).abs().max()) <= 1e-6 * float(ref.abs().max())  # every row
    assert float((out.double() - ref).norm() / ref.norm()) <= 1e-6


@pytest.mark.parametrize("isa", _tiers())
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("T,k", [(1, 4), (5, 3)])
def test_bf16_models_take_int8_activations_within_tolerance(fmt, isa, T, k):
    """A BF16 model's packed banks: through the int8 kernels where the CPU has them at the
    tier (from the AVX-512 tier up with VNNI; the K-quants from AVX2 up), within
    INT8_TOLERANCE of decode-then-matmul in fp32 and not equal to it, else exactly as an fp32
    model's; an fp32 model's stay exact."""
    spec, banks, x, ids, w = _case((fmt, fmt), "swiglu", T, k, seed=11 + T)
    ref = reference.moe_experts(x, ids, w, banks, spec)
    tok = torch.arange(T).repeat_interleave(k)
    args = (x, banks, tok, ids.reshape(-1), w.reshape(-1), spec)
    out = cpu.moe_experts(*args, isa=isa, compute_dtype=torch.bfloat16)
    err = float((out - ref).norm() / ref.norm())
    if _int8_kernel(fmt, cpu.TIERS.index(isa)):
        assert 1e-6 < err <= INT8_TOLERANCE
    else:
        assert err <= 1e-5
    assert float((cpu.moe_experts(*args, isa=isa) - ref).norm() / ref.norm()) <= 1e-5


def test_int8_activations_with_a_float_bank_beside():
    """Only the packed bank quantizes its activations: a Q4_K gate_up beside an fp32 down."""
    spec, banks, x, ids, w = _case(("q4_k", ""), "swiglu+bias", 3, 2, seed=2, dtype=torch.float32)
    ref = reference.moe_experts(x, ids, w, banks, spec)
    tok = torch.arange(3).repeat_interleave(2)
    int8 = cpu.moe_experts(
        x, banks, tok, ids.reshape(-1), w.reshape(-1), spec, compute_dtype=torch.bfloat16
    )
    assert float((int8 - ref).norm() / ref.norm()) <= INT8_TOLERANCE


@pytest.mark.parametrize("tier", INT8_TIERS)
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_k", "q5_k", "q6_k", "mxfp4", "nvfp4"])
def test_the_software_prefetch_changes_no_result(fmt, tier):
    """However far ahead the int8 kernels ask for rows (bench bw's sweep: none, less than a
    line, past the call's last row), the dot products are the same."""
    if not _int8_kernel(fmt, tier):
        pytest.skip("no int8 kernel for this format at this tier on this CPU")
    ext = cpu.extension()
    g = torch.Generator().manual_seed(9)
    rows = experts.pack(torch.randn((70, 512), generator=g), fmt)
    x = torch.randn(512, generator=g)
    code = quant.get(fmt).code
    last = ext.quant_set_prefetch_bytes(0)
    try:
        want = ext.quant_matvec(rows, x, code, tier, True)
        for ahead in (1, 100, 4096, 1 << 20):
            ext.quant_set_prefetch_bytes(ahead)
            assert torch.equal(ext.quant_matvec(rows, x, code, tier, True), want), ahead
    finally:
        ext.quant_set_prefetch_bytes(last)


@pytest.mark.parametrize("isa", [None, "avx2"])
@pytest.mark.parametrize("fmt", ["q4_k", "q8_0"])
def test_every_thread_count_gives_the_same_bits(fmt, isa):
    """Down tiles wait for their own route's h and sums for their own token's tiles, not for
    a barrier: any number of threads, more than the cores included (a waiting thread spins
    while the one it waits for is off its core), computes the same bits as one thread. The
    routes name tokens out of order and one token has none."""
    spec, banks, x, ids, w = _case([fmt, fmt], "swiglu+bias", T=4, k=3, E=8, seed=5)
    tok = torch.tensor([2, 0, 2, 0, 3, 2, 0, 3, 3])  # token 1: no routes
    exp, wt = ids.reshape(-1)[:9], w.reshape(-1)[:9]
    before = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 3, 8):
            torch.set_num_threads(n)
            args = (x, banks, tok, exp, wt, spec)
            outs.append(cpu.moe_experts(*args, isa=isa, compute_dtype=torch.bfloat16))
    finally:
        torch.set_num_threads(before)
    assert outs[0][1].abs().max() == 0 and outs[0].abs().sum() > 0
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
