"""Sampling on the GPU: top-k in two Triton kernels (kernels/triton/sample.py), and a
constrained step's bitmasks applied in one (kernels/triton/mask.py).

After a decode step the sampler is what the step waits on: torch's top-k over a 150k-token
vocabulary, then softmax, top-p and the draw over its k survivors, is a score of kernel
launches (about 0.4 ms a token on an H200, a seventh of a step). These two kernels do the
same work for k up to MAX_K; `sampling.draw` takes them on a GPU and keeps torch's form
everywhere else.
"""

from __future__ import annotations

import torch

from freetoken.kernels.triton import block

MAX_K = 64  # candidates a block keeps: the last kernel sorts blocks × this many in one program
BLOCK = 4096  # logits a program of the first kernel sorts
WARPS = 8
MASK_BLOCK = 1024  # tokens a program of the mask kernel rules on


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
        num_warps=WARPS,
    )
    return out if logits.dim() == 2 else out[0]


def warm_up(vocab: int, device: torch.device) -> None:
    """Compiles both kernels for this vocabulary (seconds the first time on a machine,
    then read from Triton's cache) while a model loads, not in its first answer."""
    logits = torch.zeros(vocab, dtype=torch.float32, device=device)
    top_k_draw(logits, 1, 1.0, 1.0, 0.0, torch.zeros(1, device=device))


def mask_bits(logits: torch.Tensor, bits: torch.Tensor) -> None:
    """-inf in fp32 logits [B, V] where a token's bit is clear in int32 words [B, W] (host,
    pinned: the copy waits for nothing) or the token is past them: one copy, one kernel."""
    from freetoken.kernels.triton import mask

    B, V = logits.shape
    words = bits.to(logits.device, non_blocking=True)
    grid = (B, -(-V // MASK_BLOCK))
    mask.mask_bits_kernel[grid](logits, words, V, words.shape[1], BLOCK=MASK_BLOCK)
