"""Copies routed experts from pinned host banks into GPU cache slots, addressed on the device.

The GPU reads the host memory itself (the banks are registered, so mapped), so which
expert goes to which slot is decided by earlier kernels and no host round trip is
needed: the copy can live inside a CUDA graph. One program per block of an expert's row,
each copying its block of every route whose slot is not negative. A warm cache fetches
nothing in most steps, yet a graph launches the fetch of every layer: with a program per
(route, block) that was 9,216 programs a layer at one token and four times that at four
streams, each reading a slot only to return; now it is a few hundred programs a layer.
A layer's two banks go in one launch (`fetch_pair_kernel`, which copies a lone bank too):
each kernel node of a captured step costs its launch and tail whether or not anything is
fetched.
"""

import triton
import triton.language as tl


@triton.jit
def _copy_block(
    src_ptr,
    dst_ptr,
    expert_ptr,
    slot_ptr,
    routes,
    row,
    stride,
    b,
    BLOCK: tl.constexpr,
    ROUTES: tl.constexpr,
):
    """Block b of every fetched route's expert: src row -> dst slot. Every route's slot is
    read in one load first: in the steps where nothing is fetched (most of a warm cache's),
    each program returns after it instead of after a load, compare and branch a route."""
    r_offs = tl.arange(0, ROUTES)
    every_slot = tl.load(slot_ptr + r_offs, mask=r_offs < routes, other=-1)
    if tl.max(every_slot, axis=0) >= 0:
        offs = b * BLOCK + tl.arange(0, BLOCK)
        mask = offs < row
        r = tl.full([], 0, tl.int32)  # a while loop: the interpreter ranges over constants only
        while r < routes:
            slot = tl.load(slot_ptr + r)
            if slot >= 0:
                e = tl.load(expert_ptr + r).to(tl.int64)
                v = tl.load(src_ptr + e * row + offs, mask=mask)
                tl.store(dst_ptr + slot.to(tl.int64) * stride + offs, v, mask=mask)
            r += 1


@triton.jit
def fetch_pair_kernel(
    src_a,
    dst_a,
    row_a,
    stride_a,
    blocks_a,
    src_b,
    dst_b,
    row_b,
    stride_b,
    expert_ptr,
    slot_ptr,
    routes,
    BLOCK: tl.constexpr,
    ROUTES: tl.constexpr,
):
    """Two banks of the same routes in one launch: the first `blocks_a` programs copy bank
    a, the rest bank b (a layer's gate_up and down: one graph node a layer instead of two;
    a grid of `blocks_a` programs copies bank a alone). row: elements of one expert in src;
    stride: of one slot in dst (>= row: a packed expert fills the first bytes of a slot
    sized for the widest format); routes: entries of expert_ptr and slot_ptr, ROUTES a power
    of two at least that."""
    pid = tl.program_id(0)
    if pid < blocks_a:
        _copy_block(src_a, dst_a, expert_ptr, slot_ptr, routes, row_a, stride_a, pid, BLOCK, ROUTES)
    else:
        _copy_block(
            src_b,
            dst_b,
            expert_ptr,
            slot_ptr,
            routes,
            row_b,
            stride_b,
            pid - blocks_a,
            BLOCK,
            ROUTES,
        )
