"""Every expert resident on one device: the baseline every offload policy must match."""

from __future__ import annotations

import torch

from freetoken.kernels import reference


class ResidentExperts:
    """banks[layer] = (gate_up [E, 2I, H], down [E, H, I]) on the compute device."""

    def __init__(self, banks: dict[int, tuple[torch.Tensor, torch.Tensor]]):
        self.banks = banks

    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        gate_up, down = self.banks[layer]
        return reference.moe_experts(x, ids, weights, gate_up, down)
