"""Routed experts over the GPU slot pool: Triton for small batches, grouped matmuls otherwise.

Both compute Σ_j weights[t, j] · expert[slots[t, j]](x[t]) over the routes whose slot is
>= 0; routes with slot -1 contribute nothing here (the CPU computes them). Packed slots
(freetoken/quant) are decoded on the fly by the small-batch kernels, and expert by expert
by a Triton kernel before the grouped matmuls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from freetoken.kernels import reference

if TYPE_CHECKING:  # kernels sit below models: the spec is read, never built, here
    from freetoken.models.base import ExpertSpec

SMALL_BATCH = 16  # routes per token-batch below which one GEMV per route beats grouped matmuls
# intermediate rows a program of the small-batch gate_up kernel computes: a miss split by its
# rows (HostRows) is cut at a multiple of it, so no program reads a block the CPU also reads
ROW_BLOCK = 16
COMBINE_BLOCK = 1024  # hidden columns per program of the routes' sum
FETCH_BLOCK = 4096  # elements per program of the fetch kernel: 8 KiB of bf16 in flight each
# packed slots (kernels/triton/moe_quant.py): rows per program of each small-batch kernel
# (each step of a program reads its rows' next 256 weights), of the prefill decoder, and the
# weights a step spans (quant.STEP)
GATE_UP_ROWS, DOWN_ROWS, DEQUANT_ROWS, QUANT_STEP = 16, 16, 16, 256
# warps per program: formats whose threads keep a product per code (all but the K-quants
# with mins, quant._summed) hold twice the registers, so they spread over twice the threads
# (about 100 registers a thread either way, on sm_90)
SUMMED_WARPS, PER_CODE_WARPS = 4, 8


@dataclass(frozen=True)
class HostRows:
    """Routes left out of the slot pool (slot -1) that the GPU computes in part: each one's
    first `rows[0]` intermediate rows, read from the pinned host banks by its expert in `ids`
    (the CPU computes the others and adds the down bias: a miss split by its rows)."""

    banks: reference.Banks  # one layer's host banks, unpacked
    ids: torch.Tensor  # [T, k] the routes' experts
    rows: torch.Tensor  # [1] int32 on the GPU: read there, so a captured step follows changes

    @staticmethod
    def takes(spec: ExpertSpec) -> bool:
        """Whether a layer's experts can be split by their rows here (unpacked banks)."""
        return not any(spec.formats)


@dataclass(frozen=True)
class Fill:
    """Routes whose slots the books fill this step, fetched by the expert kernels: each
    reads its expert from the pinned host banks by its id in `ids`, and the route first to
    it (its entry of `slots`, the slot it fills; -1 for every other route) writes it into
    the slot (a miss fetched and computed in one pass)."""

    banks: reference.Banks  # one layer's host banks, unpacked, shaped as the pool's slots
    ids: torch.Tensor  # [T, k] the routes' experts
    slots: torch.Tensor  # [T·k] int32, as DeviceLRU.assign's `fetch`

    @staticmethod
    def takes(
        x: torch.Tensor, pool: reference.Banks, spec: ExpertSpec, banks: reference.Banks
    ) -> bool:
        """Whether a step of x's tokens can fill its misses this way: the small-batch
        kernels on a GPU, host banks of the pool's banks and dtypes, each expert as its slot
        (float) or no wider than it and 4-byte aligned as the pool is (packed)."""
        if not (x.is_cuda and x.shape[0] <= SMALL_BATCH and set(banks) == set(pool)):
            return False
        if any(spec.formats) and not slots_aligned(pool, spec):
            return False
        return all(_fills(b, pool[n], bool(spec.format_of(n))) for n, b in banks.items())


def _fills(bank: torch.Tensor, slots: torch.Tensor, packed: bool) -> bool:
    """Whether the expert kernels can copy a host bank's experts into the pool's slots."""
    if bank.dtype != slots.dtype or not bank.is_contiguous():
        return False
    if not packed:  # a float bank (a float model's, or biases and a float down among packed)
        return bank.shape[1:] == slots.shape[1:]
    return (
        bank[0].numel() <= slots[0].numel() and bank.data_ptr() % 4 == 0 and bank.stride(0) % 4 == 0
    )


def experts_from_slots(
    x: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    pool: reference.Banks,
    spec: ExpertSpec,
    host: HostRows | None = None,
    fill: Fill | None = None,
) -> torch.Tensor:
    """x [T, H]; slots/weights [T, k]; `pool` the slot pool's banks (gate_up [S, 2I, H],
    down [S, H, I], biases where `spec` has them) -> [T, H] in x's dtype. `host`: routes
    with slot -1 computed in part from host memory; `fill`: the slots this step fills,
    fetched here (small batches on a GPU only)."""
    T, k = slots.shape
    if x.is_cuda and T <= SMALL_BATCH and slots_aligned(pool, spec):
        return _triton_small(x, slots, weights, pool, spec, host, fill)
    assert host is None, "a miss split by its rows needs the small-batch kernels"
    assert fill is None, "slots filled by the expert kernels need the small-batch kernels"
    return _grouped(x, slots, weights, pool, spec)


def _grouped(x, slots, weights, pool, spec) -> torch.Tensor:
    # masked routes (slot -1) are skipped, not computed at weight 0: a slot never filled
    # may hold bytes that decode to NaN, and NaN · 0 is NaN
    packed = x.is_cuda and any(spec.formats) and slots_aligned(pool, spec)
    expert = triton_expert_weights if packed else reference.expert_weights
    return reference.moe_experts(x, slots, weights, pool, spec, expert)


def slots_aligned(pool: reference.Banks, spec: ExpertSpec) -> bool:
    """Whether every packed bank's slots start 4-byte aligned: the Triton decoders read
    scales as int16/int32 words (kernels/triton/quant.py). Real pools always are (their
    rows are even in number); any other takes the plain-torch decoding."""
    return all(
        t.data_ptr() % 4 == 0 and t.stride(0) % 4 == 0  # a slot's bytes: packed banks are uint8
        for name, t in pool.items()
        if spec.format_of(name)
    )


def triton_expert_weights(
    pool: reference.Banks, slot: int, spec: ExpertSpec, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """reference.expert_weights with packed matrices decoded by a Triton kernel: a prefill
    chunk's experts each serve many tokens, so a decoded copy and a matmul are the shape."""
    from freetoken import quant
    from freetoken.kernels.triton import moe_quant

    out = {}
    for name, t in pool.items():
        fmt = spec.format_of(name)
        if not fmt:
            out[name] = t[slot].to(dtype)
            continue
        (rows, cols), f = spec.rows()[name], quant.get(fmt)
        dst = torch.empty((rows, cols), dtype=dtype, device=t.device)
        grid = (triton_cdiv(rows, DEQUANT_ROWS), triton_cdiv(cols, QUANT_STEP))
        # unfused, so that its weights are the reference's to the bit
        moe_quant.dequant_kernel[grid](
            *(t[slot], dst, rows, cols, f.code, f.block, f.block_bytes),
            BLOCK_R=DEQUANT_ROWS,
            enable_fp_fusion=False,
        )
        out[name] = dst
    return out


def _triton_small(
    x, slots, weights, pool, spec, host: HostRows | None = None, fill: Fill | None = None
) -> torch.Tensor:
    if any(spec.formats):
        assert host is None, "packed misses are not split by their rows"
        return _triton_small_packed(x, slots, weights, pool, spec, fill=fill)
    from freetoken.kernels.triton import moe_decode

    gate_up, down = pool["gate_up"], pool["down"]
    T, k = slots.shape
    S, two_i, H = gate_up.shape
    I = two_i // 2
    assert x.shape == (T, H) and down.shape == (S, H, I), "shapes disagree"
    assert gate_up.is_contiguous() and down.is_contiguous() and x.is_contiguous()
    # without biases the kernels never read their bias pointers: any tensor stands in
    gu_bias, dn_bias = (pool.get("gate_up_bias", gate_up), pool.get("down_bias", down))
    flat_slots = slots.reshape(-1).contiguous()  # any integer dtype: no cast launched
    flat_w = weights.reshape(-1).contiguous()  # the kernel reads any float dtype as fp32
    h = torch.empty((T * k, I), dtype=torch.float32, device=x.device)
    out = torch.empty((T * k, H), dtype=torch.float32, device=x.device)  # every row written
    host_args = _host_args(pool, host, fill, flat_slots)
    routes = max(triton_pow2(T * k), 2)  # the filled slots' list, as one block
    bi, bh = ROW_BLOCK, 256
    moe_decode.gate_up_kernel[(T * k, triton_cdiv(I, bi))](
        *(x, gate_up, gu_bias, flat_slots, h, spec.alpha, spec.limit),
        *(host_args["gate_up"], host_args["gate_up_bias"], *host_args["routes"]),
        H=H,
        I=I,
        K=k,
        BLOCK_I=bi,
        BLOCK_H=bh,
        HAS_BIAS=spec.bias,
        ACT=spec.activation_code,
        HOST=host is not None,
        FILL=fill is not None,
        ROUTES=routes,
    )
    bo, bk = 32, 256
    moe_decode.down_kernel[(T * k, triton_cdiv(H, bo))](
        *(h, down, dn_bias, flat_slots, flat_w, out),
        *(host_args["down"], host_args["down_bias"], *host_args["routes"]),
        H=H,
        I=I,
        BLOCK_H=bo,
        BLOCK_I=bk,
        HAS_BIAS=spec.bias,
        HOST=host is not None,
        FILL=fill is not None,
        ROUTES=routes,
    )
    return _combine(out, x, k)


def _host_args(
    pool: reference.Banks,
    host: HostRows | None,
    fill: Fill | None,
    flat_slots: torch.Tensor,
    same_shapes: bool = True,
) -> dict:
    """The host side of the small-batch kernels: each bank's host tensor, and (ids, first
    row, filled slots). Without host routes or fills the kernels never read them: the pool's
    tensors and the slots stand in (the kernels' pointers must exist and agree in type).
    `same_shapes`: host experts shaped as the slots (float banks; a packed one may be
    narrower than its slots, as Fill.takes checks)."""
    side = host or fill
    if side is None:
        banks = pool
        routes = (flat_slots, flat_slots, flat_slots)
    else:
        assert host is None or fill is None or host.ids is fill.ids, "one layer's routes"
        banks = side.banks
        for name, t in banks.items():
            assert t.dtype == pool[name].dtype, name
            assert not same_shapes or t.shape[1:] == pool[name].shape[1:], name
        ids = side.ids.reshape(-1).contiguous()
        routes = (
            ids,
            host.rows if host is not None else flat_slots,
            fill.slots if fill is not None else flat_slots,
        )
    out = {"gate_up": banks["gate_up"], "down": banks["down"], "routes": routes}
    out["gate_up_bias"] = banks.get("gate_up_bias", banks["gate_up"])
    out["down_bias"] = banks.get("down_bias", banks["down"])
    return out


def _combine(out: torch.Tensor, x: torch.Tensor, k: int) -> torch.Tensor:
    """out [T·k, H] (fp32, weighted routes) summed per token -> [T, H] in x's dtype."""
    from freetoken.kernels.triton import moe_decode

    T, H = x.shape
    y = torch.empty((T, H), dtype=x.dtype, device=x.device)
    moe_decode.combine_kernel[(T, triton_cdiv(H, COMBINE_BLOCK))](
        out, y, H=H, K=k, BLOCK_H=COMBINE_BLOCK
    )
    return y


def _format_args(spec: ExpertSpec, bank: str) -> tuple[int, int, int]:
    """(code, block, block bytes) of a bank's format for the Triton kernels; zeros: float."""
    from freetoken import quant

    fmt = spec.format_of(bank)
    f = quant.get(fmt) if fmt else None
    return (f.code, f.block, f.block_bytes) if f else (0, 1, 1)


def _warps(code: int) -> int:
    return SUMMED_WARPS if code in (3, 4) else PER_CODE_WARPS  # q4_k, q5_k: quant._summed


def _triton_small_packed(
    x,
    slots,
    weights,
    pool,
    spec,
    rows: tuple[int, int] | None = None,
    num_warps: int = 0,
    fill: Fill | None = None,
) -> torch.Tensor:
    """_triton_small over packed slots: the same two passes, each step of whole blocks decoded
    in registers where it is read (kernels/triton/moe_quant.py). `rows` (rows per program of
    the gate_up and down kernels) and `num_warps` override the defaults (for benchmarks);
    `fill`: the slots this step fills, fetched by the kernels."""
    from freetoken.kernels.triton import moe_quant

    gu_rows, dn_rows = rows or (GATE_UP_ROWS, DOWN_ROWS)

    gate_up, down = pool["gate_up"], pool["down"]
    T, k = slots.shape
    H, I = spec.hidden, spec.intermediate
    assert x.shape == (T, H) and x.is_contiguous(), "shapes disagree"
    assert gate_up.is_contiguous() and down.is_contiguous()
    flat_slots = slots.reshape(-1).contiguous()  # any integer dtype: no cast launched
    flat_w = weights.reshape(-1).contiguous()
    h = torch.empty((T * k, I), dtype=torch.float32, device=x.device)
    out = torch.empty((T * k, H), dtype=torch.float32, device=x.device)  # every row written
    gu_fmt, dn_fmt = _format_args(spec, "gate_up"), _format_args(spec, "down")
    gu_bias, dn_bias = (pool.get("gate_up_bias", gate_up), pool.get("down_bias", down))
    side = _host_args(pool, None, fill, flat_slots, same_shapes=False)
    ids, fills = side["routes"][0], side["routes"][2]
    common = {"FILL": fill is not None, "ROUTES": max(triton_pow2(T * k), 2)}
    moe_quant.gate_up_q_kernel[(T * k, triton_cdiv(I, gu_rows))](
        *(x, gate_up, gu_bias, flat_slots, h, spec.alpha, spec.limit),
        *(side["gate_up"], side["gate_up_bias"], ids, fills, side["gate_up"].stride(0)),
        *(H, I, k, gate_up[0].numel(), *gu_fmt),
        BLOCK_I=gu_rows,
        HAS_BIAS=spec.bias,
        ACT=spec.activation_code,
        WORD=_copy_word(spec, "gate_up", H),
        num_warps=num_warps or _warps(gu_fmt[0]),
        **common,
    )
    moe_quant.down_q_kernel[(T * k, triton_cdiv(H, dn_rows))](
        *(h, down, dn_bias, flat_slots, flat_w, out),
        *(side["down"], side["down_bias"], ids, fills, side["down"].stride(0)),
        *(H, I, down[0].numel(), *dn_fmt),
        BLOCK_H=dn_rows,
        HAS_BIAS=spec.bias,
        WORD=_copy_word(spec, "down", I),
        num_warps=num_warps or _warps(dn_fmt[0]),
        **common,
    )
    return _combine(out, x, k)


def _copy_word(spec: ExpertSpec, bank: str, cols: int) -> int:
    """The word a fill copies a packed bank's rows in: the widest that divides a row's bytes
    (0 for a float bank: its own elements)."""
    from freetoken import quant

    if not (fmt := spec.format_of(bank)):
        return 0
    row = quant.get(fmt).row_bytes(cols)
    return 4 if row % 4 == 0 else 2 if row % 2 == 0 else 1


def fetch_experts(
    src: torch.Tensor, dst: torch.Tensor, experts: torch.Tensor, slots: torch.Tensor
) -> None:
    """dst[slots[r]] = src[experts[r]] for every route r whose slot is >= 0.

    src [E, ...] is a bank in pinned host memory, dst [S, ...] the slot pool, whose slots may
    be wider than src's experts (a packed expert fills the first bytes of its slot). On a
    GPU the GPU reads the bank itself: no host work, so the copy can be captured in a CUDA
    graph.
    """
    if dst.is_cuda:
        _fetch_launch((src, dst), (src, dst), experts, slots, pair=False)
        return
    row, stride = src[0].numel(), dst[0].numel()
    assert src.is_contiguous() and dst.is_contiguous() and stride >= row, "shapes disagree"
    keep = slots >= 0
    rows = src.reshape(src.shape[0], -1).index_select(0, experts[keep].long())
    dst.reshape(dst.shape[0], -1)[:, :row].index_copy_(0, slots[keep].long(), rows)


def fetch_banks(
    banks: list[tuple[torch.Tensor, torch.Tensor]], experts: torch.Tensor, slots: torch.Tensor
) -> None:
    """`fetch_experts` for each (src, dst) of a layer's banks, two banks a launch on a GPU."""
    if not banks or not banks[0][1].is_cuda:
        for src, dst in banks:
            fetch_experts(src, dst, experts, slots)
        return
    for i in range(0, len(banks) - 1, 2):
        _fetch_launch(banks[i], banks[i + 1], experts, slots, pair=True)
    if len(banks) % 2:
        fetch_experts(*banks[-1], experts, slots)


def _fetch_launch(
    a: tuple[torch.Tensor, torch.Tensor],
    b: tuple[torch.Tensor, torch.Tensor],
    experts: torch.Tensor,
    slots: torch.Tensor,
    pair: bool,
) -> None:
    """One launch of the fetch kernel: bank a's blocks, then bank b's if `pair`."""
    from freetoken.kernels.triton import fetch

    (src_a, dst_a), (src_b, dst_b) = a, b
    row_a, stride_a, row_b, stride_b = (t[0].numel() for t in (src_a, dst_a, src_b, dst_b))
    assert stride_a >= row_a and stride_b >= row_b, "shapes disagree"
    assert all(t.is_contiguous() for t in (src_a, dst_a, src_b, dst_b)), "not contiguous"
    blocks_a = triton_cdiv(row_a, FETCH_BLOCK)
    grid = (blocks_a + (triton_cdiv(row_b, FETCH_BLOCK) if pair else 0),)
    fetch.fetch_pair_kernel[grid](
        *(src_a, dst_a, row_a, stride_a, blocks_a),
        *(src_b, dst_b, row_b, stride_b),
        *(experts, slots, slots.numel()),
        BLOCK=FETCH_BLOCK,
        ROUTES=triton_pow2(slots.numel()),
    )


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def triton_pow2(n: int) -> int:
    """The least power of two >= n (and >= 1): a block size Triton takes."""
    return 1 << max(n - 1, 0).bit_length()
