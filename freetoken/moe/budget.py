"""What GPU memory a model takes besides its dense weights, KV cache and cached experts.
Torch-free: the server's check before a load counts with it too."""

from __future__ import annotations

__all__ = ["ACTIVATION_RESERVE"]

ACTIVATION_RESERVE = 768 << 20  # workspace for prefill chunks and the allocator's slack
