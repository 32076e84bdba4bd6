"""Compute kernels: plain-torch references, CPU (C++) and GPU (Triton) implementations."""
