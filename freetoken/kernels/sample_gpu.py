"""Sampling on the GPU: top-k in two Triton kernels (kernels/triton/sample.py), the draw
from a wide candidate set without a sort (kernels/triton/sample_wide.py), and a constrained
step's bitmasks applied in one kernel (kernels/triton/mask.py).

After a decode step the sampler is what the step waits on: torch's top-k over a 150k-token
vocabulary, then softmax, top-p and the draw over its k survivors, is a score of kernel
launches (about 0.4 ms a token on an H200, a seventh of a step); with a large k or none,
torch ranked or sorted the whole vocabulary (0.8 ms a row). `takes` says which draws these
kernels make; `sampling.draw` and `batch_draw` send those here on a GPU and keep torch's
form everywhere else.
"""

from __future__ import annotations

import math

import torch

from freetoken.kernels.triton import block

MAX_K = 64  # candidates a block keeps: the last kernel ranks blocks × this many in one program
# logits a program of the first kernel ranks: on an H200 a draw took 90 µs with 2048, 115 with
# 4096 and 106 with 8192 (more programs at once against a longer last rank)
BLOCK = 2048
WARPS = 8
MASK_BLOCK = 1024  # tokens a program of the mask kernel rules on
# logits a program of the wide draw reads: 151 µs a draw with 4096, 236 with 2048, 260 with
# 1024 (each program re-derives the radix select's digits, so fewer programs do less)
WIDE_BLOCK = 4096


def takes(k: int, vocab: int, top_p: float) -> bool:
    """Whether the kernels draw with these options: a top-k they sort (0 < k <= MAX_K), or
    every candidate that k leaves where top_p keeps them all (the wide draw walks them in
    token order, which top_p's prefix of the likeliest cannot use)."""
    return 0 < k <= min(MAX_K, vocab - 1) or not 0.0 < top_p < 1.0


def draw(
    logits: torch.Tensor, k: int, temperature: float, top_p: float, min_p: float, u: torch.Tensor
) -> torch.Tensor:
    """The token drawn at uniform `u` as `takes` allows: logits [V] or [B, V] (fp32), u [1]
    or [B]; a 0-d token or tokens [B]."""
    V = logits.shape[-1]
    if 0 < k <= min(MAX_K, V - 1):
        return top_k_draw(logits, k, temperature, top_p, min_p, u)
    assert takes(k, V, top_p)
    return wide_draw(logits, k if 0 < k < V else 0, temperature, min_p, u)


def top_k_draw(
    logits: torch.Tensor, k: int, temperature: float, top_p: float, min_p: float, u: torch.Tensor
) -> torch.Tensor:
    """The token drawn at uniform `u` from fp32 logits restricted to their k largest,
    0 < k <= MAX_K, k < V: probabilities at `temperature` (> 0), then top_p and min_p as
    `sampling.draw` applies them. One row: logits [V], u [1], a 0-d int64 token; rows
    drawn alike in one launch: logits [B, V], u [B], tokens [B]."""
    from freetoken.kernels.triton import sample

    rows = logits.view(-1, logits.shape[-1])
    B, V = rows.shape
    assert 0 < k <= MAX_K and k < V and logits.dtype == torch.float32 and rows.is_contiguous()
    assert u.numel() == B
    # every block keeps MAX_K whatever k is: one compiled form a vocabulary size, not one a k
    kp = MAX_K
    blocks = -(-V // BLOCK)
    keys = torch.empty(B * blocks * kp, dtype=torch.int64, device=logits.device)
    sample.block_top_kernel[(blocks, B)](rows, V, keys, KP=kp, BLOCK=BLOCK, num_warps=WARPS)
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    nucleus = top_p if 0.0 < top_p < 1.0 else 2.0  # above 1: every candidate's mass counts
    sample.pick_kernel[(B,)](
        keys,
        blocks * kp,
        u,
        out,
        k,
        1.0 / temperature,
        nucleus,
        max(min_p, 0.0),
        NC=block(blocks * kp),
        KP=kp,
        num_warps=WARPS,
    )
    return out if logits.dim() == 2 else out[0]


def wide_draw(
    logits: torch.Tensor, k: int, temperature: float, min_p: float, u: torch.Tensor
) -> torch.Tensor:
    """The token drawn at uniform `u` from fp32 logits restricted to those at or above the
    k-th largest (0: every one) and to weights at least min_p times the likeliest's, with
    probabilities at `temperature` (> 0), counting the survivors in token order. Shapes as
    `top_k_draw`'s."""
    from freetoken.kernels.triton import sample_wide as sw

    rows = logits.view(-1, logits.shape[-1])
    B, V = rows.shape
    assert 0 <= k < V and logits.dtype == torch.float32 and rows.is_contiguous()
    assert u.numel() == B
    blocks, need = -(-V // WIDE_BLOCK), k > 0
    # one zeroed buffer: each row's histograms (int32) and then its largest key (int64)
    per_row = 3 * sw.NB // 2 + 1
    state = torch.zeros(B, per_row, dtype=torch.int64, device=logits.device)
    hist = state.view(torch.int32)
    sums = torch.empty(B, blocks, dtype=torch.float32, device=logits.device)
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    kw = dict(BLOCK=WIDE_BLOCK, NB=sw.NB, ROW=per_row)
    for p in range(sw.PASSES if need else 1):
        sw.rank_kernel[(blocks, B)](rows, V, hist, state, k, p, need, **kw)
    inv_temp = 1.0 / temperature
    floor = math.log(min_p) if min_p > 0.0 else float("-inf")
    sw.mass_kernel[(blocks, B)](rows, V, hist, state, sums, k, inv_temp, floor, need, **kw)
    draw_args = (rows, V, hist, state, sums, blocks, u, out, k, inv_temp, floor, need)
    sw.draw_kernel[(B,)](*draw_args, NBLK=block(blocks), **kw)
    return out if logits.dim() == 2 else out[0]


def warm_up(vocab: int, device: torch.device) -> None:
    """Compiles the kernels for this vocabulary (seconds the first time on a machine, then
    read from Triton's cache) while a model loads, not in its first answer. Triton compiles
    an integer argument of 1, one that is a multiple of 16 and any other as three forms, so
    k takes one value of each: Ollama's default 40 was compiled inside the first answer
    while the load warmed k = 1 alone."""
    logits = torch.zeros(vocab, dtype=torch.float32, device=device)
    u = torch.zeros(1, device=device)
    for k in warm_ks(min(MAX_K, vocab - 1)):
        top_k_draw(logits, k, 1.0, 1.0, 0.0, u)
    if vocab > 2:
        wide_draw(logits, 0, 1.0, 0.0, u)
        for k in warm_ks(vocab - 1)[1:]:  # a k of 1 is the top-k kernels'
            wide_draw(logits, k, 1.0, 0.0, u)


def warm_ks(most: int) -> list[int]:
    """One k of each form Triton compiles separately (1, a multiple of 16, any other), the
    largest of each up to `most`."""
    ks = {1, most // 16 * 16, most if most % 16 else most - 1}
    return sorted(k for k in ks if 1 <= k <= most)


def mask_bits(logits: torch.Tensor, bits: torch.Tensor) -> None:
    """-inf in fp32 logits [B, V] where a token's bit is clear in int32 words [B, W] (host,
    pinned: the copy waits for nothing) or the token is past them: one copy, one kernel."""
    from freetoken.kernels.triton import mask

    B, V = logits.shape
    words = bits.to(logits.device, non_blocking=True)
    grid = (B, -(-V // MASK_BLOCK))
    mask.mask_bits_kernel[grid](logits, words, V, words.shape[1], BLOCK=MASK_BLOCK)
