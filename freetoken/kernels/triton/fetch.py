"""Copies routed experts from pinned host banks into GPU cache slots, addressed on the device.

The GPU reads the host memory itself (the banks are registered, so mapped), so which
expert goes to which slot is decided by earlier kernels and no host round trip is
needed: the copy can live inside a CUDA graph. One program per (route, block of the
expert's row); routes whose slot is negative copy nothing.
"""

import triton
import triton.language as tl


@triton.jit
def fetch_kernel(src_ptr, dst_ptr, expert_ptr, slot_ptr, row, stride, BLOCK: tl.constexpr):
    """row: elements of one expert in src; stride: of one slot in dst (>= row: a packed
    expert fills the first bytes of a slot sized for the widest format)."""
    r = tl.program_id(0)
    slot = tl.load(slot_ptr + r)
    if slot < 0:
        return
    e = tl.load(expert_ptr + r).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row
    v = tl.load(src_ptr + e * row + offs, mask=mask)
    tl.store(dst_ptr + slot.to(tl.int64) * stride + offs, v, mask=mask)
