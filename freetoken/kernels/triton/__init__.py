"""Triton kernels (GPU only; imported lazily by their launchers)."""
