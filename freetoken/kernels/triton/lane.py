"""The GPU side of the CPU lane (`freetoken/kernels/cpu/lane.cpp`), capturable in a CUDA graph.

`post_kernel` looks whether the layer gives the CPU any route; only then does it write T tokens'
activations, their CPU routes (others as -1, token-major), the routes' weights, the layer's
position, the routes a token, T and the first row the CPU computes straight into the pinned
mailbox, and raise the sequence
number there. A layer with nothing for the CPU costs one small kernel: no copy (two copies a
layer, whether anything was posted or not, made a split step with no CPU route ~0.2 ms slower
than the device's at 12 layers). The number is stored after a barrier and a system-scope
fence, so the loop never sees a new number before its request: CUDA orders a thread's writes
before such a fence ahead of its writes after it for host threads too. No atomic touches host
memory (PCIe need not support them). `collect_kernel` polls `done` in host memory with
volatile loads (a read-modify-write would race the CPU's store) and adds the CPU's output to
the GPU's partial sums (T rows); after `max_spins` polls it gives up, counts a timeout and adds
nothing, so a lane that died cannot hang the GPU. It adds its polls to a device counter: few
polls a request mean the CPU answered before the GPU's own share was done.
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
    seq_ptr,
    pend_ptr,
    count_ptr,
    rows_ptr,
    layer_pos,
    k,
    tokens,
    H: tl.constexpr,
    BLOCK_H: tl.constexpr,
    K: tl.constexpr,
    FENCE: tl.constexpr,
):
    """k: routes a token; K: a power of two at least tokens · k; rows_ptr: the first
    intermediate row the CPU computes (the GPU reads those before it: a miss split by its
    rows); FENCE: emit the system fence (off only in Triton's interpreter, where stores land
    in order anyway)."""
    r = tl.arange(0, K)
    rm = r < k * tokens
    cpu = (tl.load(cpu_ptr + r, mask=rm, other=0) != 0) & rm
    pend = tl.sum(cpu.to(tl.int64), axis=0) > 0
    seq = tl.load(count_ptr) + pend.to(tl.int64)
    tl.store(pend_ptr, pend.to(tl.int64))
    tl.store(count_ptr, seq)
    if pend:
        offs = tl.arange(0, BLOCK_H)
        _copy_rows(x_ptr, mb_x, tokens * H, offs, BLOCK_H)
        ids = tl.load(ids_ptr + r, mask=rm, other=-1).to(tl.int64)
        tl.store(mb_ids + r, tl.where(cpu, ids, -1), mask=rm)
        tl.store(mb_w + r, tl.load(w_ptr + r, mask=rm, other=0).to(tl.float32), mask=rm)
        tl.store(mb_pos, layer_pos.to(tl.int64))
        tl.store(mb_pos + 1, k.to(tl.int64))
        tl.store(mb_pos + 2, tokens.to(tl.int64))
        tl.store(mb_pos + 3, tl.load(rows_ptr).to(tl.int64))
        tl.debug_barrier()  # every thread's stores of the request, before any thread's fence
        one = tl.arange(0, 1)
        seqs = tl.zeros([1], tl.int64) + seq
        if FENCE:
            seqs = tl.inline_asm_elementwise(
                "fence.sc.sys;\n mov.b64 $0, $1;", "=l,l", [seqs], tl.int64, False, 1
            )
        tl.store(seq_ptr + one, seqs)


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
