"""Triton kernels (GPU only; imported lazily by their launchers). This package itself
imports nothing from Triton, so launchers may use its helpers anywhere."""


def block(n: int) -> int:
    """The power of two at or above n: a block size or a constexpr length."""
    return 1 << max(n - 1, 0).bit_length()
