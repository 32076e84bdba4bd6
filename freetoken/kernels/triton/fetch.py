"""Copies routed experts from pinned host banks into GPU cache slots, addressed on the device.

The GPU reads the host memory itself (the banks are registered, so mapped), so which
expert goes to which slot is decided by earlier kernels and no host round trip is
needed: the copy can live inside a CUDA graph. One program per block of an expert's row,
each copying its block of every route whose slot is not negative. A warm cache fetches
nothing in most steps, yet a graph launches the fetch of every layer: with a program per
(route, block) that was 9,216 programs a layer at one token and four times that at four
streams, each reading a slot only to return; now it is a few hundred programs a layer.
"""

import triton
import triton.language as tl


@triton.jit
def fetch_kernel(src_ptr, dst_ptr, expert_ptr, slot_ptr, routes, row, stride, BLOCK: tl.constexpr):
    """row: elements of one expert in src; stride: of one slot in dst (>= row: a packed
    expert fills the first bytes of a slot sized for the widest format); routes: entries of
    expert_ptr and slot_ptr."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row
    r = tl.full([], 0, tl.int32)  # a while loop: the interpreter ranges over constants only
    while r < routes:
        slot = tl.load(slot_ptr + r)
        if slot >= 0:
            e = tl.load(expert_ptr + r).to(tl.int64)
            v = tl.load(src_ptr + e * row + offs, mask=mask)
            tl.store(dst_ptr + slot.to(tl.int64) * stride + offs, v, mask=mask)
        r += 1
