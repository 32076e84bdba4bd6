"""Whether the layers run their one-kernel Triton forms on a GPU.

At one token a step, decode is bound by how many kernels it launches, not by their work, so
the norms, the router, the KV write and decode attention each have a fused form
(kernels/triton/). The torch code beside each is what the fused form is tested against and
what runs everywhere else.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

ENABLED = True  # the runner sets it from FREETOKEN_FUSED_KERNELS


def usable(x: torch.Tensor, *same_dtype: torch.Tensor) -> bool:
    """A fused kernel takes contiguous, non-empty GPU tensors of one dtype."""
    return (
        ENABLED
        and x.is_cuda
        and x.is_contiguous()
        and x.numel() > 0
        and all(t.dtype == x.dtype and t.is_contiguous() for t in same_dtype)
    )


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """The torch code for the layers' calls inside (a reference, or a comparison)."""
    global ENABLED
    was, ENABLED = ENABLED, False
    try:
        yield
    finally:
        ENABLED = was
