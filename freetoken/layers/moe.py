"""The MoE block front: router -> experts op -> (weights already applied) output.

Model files build `SparseMoeBlock` from a router (layers/routers.py), an `Experts` op and,
where the family has them, shared experts with an optional sigmoid gate; they never see
where experts live. The `Experts` op forwards to a backend installed by the loader (an
`moe.backend.ExpertBackend`: resident weights, the GPU expert cache with its CPU/PCIe
split, experts spread over GPUs), always with a whole batch: hidden [T, H], ids [T, k],
weights [T, k].
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from freetoken.layers.routers import Router, SigmoidGroupedTopK, TopKRouter

if TYPE_CHECKING:  # layers sit below models: the spec is read, never built, here
    from freetoken.models.base import ExpertSpec

__all__ = ["Experts", "ExpertsOp", "Router", "SigmoidGroupedTopK", "SparseMoeBlock", "TopKRouter"]


class ExpertsOp(Protocol):
    """What a MoE layer calls: Σ_j weights[t, j] · expert[ids[t, j]](x[t]) for its layer."""

    def __call__(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor: ...


class Experts(nn.Module):
    """out[t] = Σ_j weights[t, j] · expert[ids[t, j]](x[t]); each expert computes `spec`."""

    def __init__(self, layer: int, num_experts: int, spec: ExpertSpec):
        super().__init__()
        self.layer, self.num_experts, self.spec = layer, num_experts, spec
        self.backend: ExpertsOp | None = None

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.backend is None:
            raise RuntimeError(
                f"experts of layer {self.layer} have no backend: load the model with the loader"
            )
        return self.backend(self.layer, x, ids, weights)


class SparseMoeBlock(nn.Module):
    """router -> routed experts, plus shared experts (always on) scaled by σ(shared_gate(x))
    where the family gates them."""

    def __init__(
        self,
        router: Router,
        experts: Experts,
        shared_experts: nn.Module | None = None,
        shared_gate: nn.Module | None = None,
    ):
        super().__init__()
        self.gate, self.experts = router, experts
        self.shared_experts, self.shared_gate = shared_experts, shared_gate

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """token_ids [T]: the step's tokens, for a router that chooses by them."""
        weights, ids = self.gate(x, token_ids) if self.gate.by_token else self.gate(x)
        out = self.experts(x, ids, weights)
        if self.shared_experts is not None:
            shared = self.shared_experts(x)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x)) * shared
            out = out + shared
        return out
