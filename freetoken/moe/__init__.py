"""Expert backends behind the MoE block's experts op (placement, caching, offload)."""
