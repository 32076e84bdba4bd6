"""A constrained step's bitmasks applied to its logits in one kernel.

The torch formulation is a byte-to-index copy, a gather of ±inf bounds and a minimum (and
a fill for the tokens past the words): four launches a step from the engine thread, which
at a 1 ms step is the cost that matters, not the bytes each moves.
"""

import triton
import triton.language as tl


@triton.jit
def mask_bits_kernel(logits_ptr, bits_ptr, V, W, BLOCK: tl.constexpr):
    """fp32 logits [B, V] (rows contiguous) -> -inf where the token's bit is clear in the
    int32 words [B, W] (token t: bit t % 32 of word t // 32) or t >= 32·W; grid (B, blocks
    of V)."""
    row = tl.program_id(0).to(tl.int64)
    tok = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = tok < V
    word = tl.load(bits_ptr + row * W + tok // 32, mask=inside & (tok < W * 32), other=0)
    out = ((word >> (tok % 32)) & 1) == 0
    # only the ruled-out tokens are written, and no logit is read
    tl.store(
        logits_ptr + row * V + tok, tl.full([BLOCK], float("-inf"), tl.float32), mask=inside & out
    )
