"""Shared building blocks for model files: norms, rotary embeddings, attention, MoE."""
