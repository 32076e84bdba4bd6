"""The MoE block front: router -> experts op -> (weights already applied) output.

Model files build `SparseMoeBlock`; they never see where experts live. The `Experts` op
forwards to a backend installed by the loader (resident weights, the GPU expert cache with
CPU/PCIe split, ...), always with a whole batch: hidden [T, H], ids [T, k], weights [T, k].
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.kernels.triton import block
from freetoken.layers import fused


class ExpertBackend(Protocol):
    def __call__(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor: ...


class TopKRouter(nn.Module):
    """Softmax over expert logits (in fp32), top-k, optionally renormalised over the k."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, norm_topk_prob: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight)
        E = logits.shape[-1]
        if fused.usable(logits) and E <= 4096 and self.top_k <= E:
            from freetoken.kernels.triton import router

            T = logits.shape[0]
            weights = torch.empty((T, self.top_k), dtype=x.dtype, device=x.device)
            ids = torch.empty((T, self.top_k), dtype=torch.int64, device=x.device)
            router.topk_softmax_kernel[(T,)](
                logits,
                weights,
                ids,
                E,
                RENORM=self.norm_topk_prob,
                K=self.top_k,
                BLOCK_E=block(E),
                BLOCK_K=block(self.top_k),
            )
            return weights, ids
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids


class Experts(nn.Module):
    """out[t] = Σ_j weights[t, j] · expert[ids[t, j]](x[t]); experts are SwiGLU FFNs."""

    def __init__(self, layer: int, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.layer, self.num_experts = layer, num_experts
        self.hidden, self.intermediate = hidden, intermediate
        self.backend: ExpertBackend | None = None

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.backend is None:
            raise RuntimeError(
                f"experts of layer {self.layer} have no backend: load the model with the loader"
            )
        return self.backend(self.layer, x, ids, weights)


class SparseMoeBlock(nn.Module):
    def __init__(
        self,
        layer: int,
        hidden: int,
        intermediate: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
    ):
        super().__init__()
        self.gate = TopKRouter(hidden, num_experts, top_k, norm_topk_prob)
        self.experts = Experts(layer, num_experts, hidden, intermediate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        return self.experts(x, ids, weights)
