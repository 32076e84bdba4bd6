"""The GPU side of the CPU lane (`freetoken/kernels/cpu/lane.cpp`), capturable in a CUDA graph.

`post_kernel` writes T tokens' activations, their CPU routes (others as -1, token-major),
the routes' weights, the layer's position, the routes a token and T into a device buffer,
and moves the device's sequence number on when the layer has CPU routes. The caller then
copies the request's bytes of that buffer, and after them the sequence number, into pinned
memory with two ordinary copies: the second starts only once the first has landed, so the
loop never sees a new number before its request — an ordering that GPU stores or atomics
into host memory over PCIe would not promise. `collect_kernel` polls `done` in host memory
with volatile loads (a read-modify-write would race the CPU's store) and adds the CPU's
output to the GPU's partial sums (T rows); after `max_spins` polls it gives up, counts a
timeout and adds nothing, so a lane that died cannot hang the GPU. It adds its polls to a
device counter: few polls a request mean the CPU answered before the GPU's own share was
done.
"""

import triton
import triton.language as tl


# a position, k or T of 1 would become a constant
@triton.jit(do_not_specialize=["layer_pos", "k", "tokens"])
def post_kernel(
    x_ptr,
    ids_ptr,
    w_ptr,
    cpu_ptr,
    mb_x,
    mb_ids,
    mb_w,
    mb_pos,
    pend_ptr,
    count_ptr,
    layer_pos,
    k,
    tokens,
    H: tl.constexpr,
    BLOCK_H: tl.constexpr,
    K: tl.constexpr,
):
    """k: routes a token; K: a power of two at least tokens · k."""
    offs = tl.arange(0, BLOCK_H)
    _copy_rows(x_ptr, mb_x, tokens * H, offs, BLOCK_H)
    r = tl.arange(0, K)
    rm = r < k * tokens
    cpu = (tl.load(cpu_ptr + r, mask=rm, other=0) != 0) & rm
    ids = tl.load(ids_ptr + r, mask=rm, other=-1).to(tl.int64)
    tl.store(mb_ids + r, tl.where(cpu, ids, -1), mask=rm)
    tl.store(mb_w + r, tl.load(w_ptr + r, mask=rm, other=0).to(tl.float32), mask=rm)
    tl.store(mb_pos, layer_pos.to(tl.int64))
    tl.store(mb_pos + 1, k.to(tl.int64))
    tl.store(mb_pos + 2, tokens.to(tl.int64))
    pend = tl.sum(cpu.to(tl.int64), axis=0) > 0
    tl.store(pend_ptr, pend.to(tl.int64))
    tl.store(count_ptr, tl.load(count_ptr) + pend.to(tl.int64))


@triton.jit(do_not_specialize=["tokens"])
def collect_kernel(
    y_ptr,
    out_ptr,
    mb_out,
    ctl_ptr,
    pend_ptr,
    count_ptr,
    polls_ptr,
    max_spins,
    tokens,
    H: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    offs = tl.arange(0, BLOCK_H)
    if tl.load(pend_ptr) > 0:
        seq = tl.load(count_ptr)
        spins = 0
        done = tl.load(ctl_ptr + 1, volatile=True)
        while (done < seq) & (spins < max_spins):
            done = tl.load(ctl_ptr + 1, volatile=True)
            spins += 1
        ok = done >= seq
        tl.store(polls_ptr, tl.load(polls_ptr) + spins)
        if done < seq:
            tl.store(ctl_ptr + 6, tl.load(ctl_ptr + 6, volatile=True) + 1)
        n = tokens * H
        h0 = tl.full([], 0, tl.int32)
        while h0 < n:
            m = h0 + offs < n
            add = tl.load(mb_out + h0 + offs, mask=m & ok, other=0.0, volatile=True)
            y = tl.load(y_ptr + h0 + offs, mask=m).to(tl.float32)
            tl.store(out_ptr + h0 + offs, (y + add).to(out_ptr.dtype.element_ty), mask=m)
            h0 += BLOCK_H
    else:
        _copy_rows(y_ptr, out_ptr, tokens * H, offs, BLOCK_H)


@triton.jit
def _copy_rows(src, dst, n, offs, BLOCK_H: tl.constexpr):
    """n elements of src into dst (converted to dst's type), BLOCK_H at a time: a while loop,
    as the interpreter ranges over constants only."""
    h0 = tl.full([], 0, tl.int32)
    while h0 < n:
        m = h0 + offs < n
        v = tl.load(src + h0 + offs, mask=m)
        tl.store(dst + h0 + offs, v.to(dst.dtype.element_ty), mask=m)
        h0 += BLOCK_H
