"""Routers: hidden states [T, H] -> (weights [T, k] in the hidden dtype, expert ids [T, k]).

Each is a small layer holding its checkpoint parameters; `SparseMoeBlock` takes any of them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.kernels.triton import block
from freetoken.layers import fused

__all__ = ["Router", "SigmoidGroupedTopK", "SoftmaxGroupedTopK", "TopKRouter"]


class Router(nn.Module):
    """What every router is: `weight` [E, H] scoring each expert, and `top_k`."""

    top_k: int

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


class TopKRouter(Router):
    """Softmax over expert logits (in fp32), top-k, optionally renormalised over the k
    (Qwen-MoE, Mixtral, OLMoE); with `bias`, the logits carry a learned bias (gpt-oss)."""

    def __init__(
        self, hidden: int, num_experts: int, top_k: int, norm_topk_prob: bool, bias: bool = False
    ):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))
        self.bias = nn.Parameter(torch.zeros(num_experts)) if bias else None
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight, self.bias)
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


class SigmoidGroupedTopK(Router):
    """DeepSeek-V3 / GLM-4.5 routing, in fp32: sigmoid scores; experts are chosen by score
    plus a correction bias, first the `topk_group` best of `n_group` groups (a group scored
    by its two best experts), then the top k inside them; the weights are the chosen
    experts' plain scores, optionally renormalised, times `routed_scaling`. One group is
    plain sigmoid top-k with a correction bias (MiniMax-M2)."""

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        *,
        n_group: int = 1,
        topk_group: int = 1,
        norm_topk_prob: bool = True,
        routed_scaling: float = 1.0,
        correction_bias: bool = True,
    ):
        super().__init__()
        if num_experts % n_group:
            raise ValueError(f"{num_experts} experts do not split into {n_group} groups")
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))
        # a parameter, not a buffer, so that it loads with the checkpoint's dense tensors
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(num_experts)) if correction_bias else None
        )
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.norm_topk_prob, self.routed_scaling = norm_topk_prob, routed_scaling

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [T, E]
        choice = scores
        if self.e_score_correction_bias is not None:
            choice = scores + self.e_score_correction_bias.float()
        if self.n_group > 1:
            T, E = choice.shape
            grouped = choice.view(T, self.n_group, E // self.n_group)
            group_scores = grouped.topk(min(2, E // self.n_group), dim=-1)[0].sum(dim=-1)
            keep = torch.topk(group_scores, self.topk_group, dim=-1, sorted=False)[1]
            mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            choice = grouped.masked_fill(~mask[:, :, None], float("-inf")).view(T, E)
        ids = torch.topk(choice, self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return (weights * self.routed_scaling).to(x.dtype), ids


class SoftmaxGroupedTopK(Router):
    """DeepSeek-V2 routing, in fp32: softmax over every expert's logit, then the top k of
    them ("greedy"), or of the experts in the `topk_group` best of `n_group` groups, a group
    scored by its best expert ("group_limited_greedy"); the weights are the chosen
    probabilities times `routed_scaling`, not renormalised (as transformers computes it)."""

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        *,
        n_group: int = 1,
        topk_group: int = 1,
        routed_scaling: float = 1.0,
    ):
        super().__init__()
        if num_experts % n_group:
            raise ValueError(f"{num_experts} experts do not split into {n_group} groups")
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.routed_scaling = routed_scaling

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = F.linear(x.float(), self.weight.float()).softmax(dim=-1)  # [T, E]
        if self.n_group > 1:
            T, E = probs.shape
            grouped = probs.view(T, self.n_group, E // self.n_group)
            keep = grouped.amax(dim=-1).topk(self.topk_group, dim=-1, sorted=False)[1]
            mask = torch.zeros((T, self.n_group), dtype=torch.bool, device=x.device)
            probs = grouped.masked_fill(~mask.scatter_(1, keep, True)[:, :, None], 0.0).view(T, E)
        weights, ids = torch.topk(probs, self.top_k, dim=-1, sorted=False)
        return (weights * self.routed_scaling).to(x.dtype), ids
