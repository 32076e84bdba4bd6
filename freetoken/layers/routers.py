"""Routers: hidden states [T, H] -> (weights [T, k] in the hidden dtype, expert ids [T, k]).

Each is a small layer holding its checkpoint parameters; `SparseMoeBlock` takes any of them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.kernels.triton import block
from freetoken.layers import fused

__all__ = [
    "SCORES",
    "HashRouter",
    "Router",
    "ScoredTopK",
    "SigmoidGroupedTopK",
    "SoftmaxBiasedTopK",
    "SoftmaxGroupedTopK",
    "TopKRouter",
]


class Router(nn.Module):
    """What every router is: `weight` [E, H] scoring each expert, and `top_k`. A router
    `by_token` chooses by the token ids too: it is called as router(x, token_ids)."""

    top_k: int
    by_token: bool = False

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


class SoftmaxBiasedTopK(Router):
    """ERNIE-4.5 routing, in fp32: softmax over every expert's logit; experts chosen by
    probability plus a correction bias; the weights the chosen plain probabilities,
    renormalised over the k with the sum held at `norm_min` or more. The bias is [1, E], as
    checkpoints store it (one group of experts)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, norm_min: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(1, num_experts))
        self.top_k, self.norm_min = top_k, norm_min

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = F.linear(x.float(), self.weight.float()).softmax(dim=-1)  # [T, E]
        choice = probs + self.e_score_correction_bias.float()
        ids = torch.topk(choice, self.top_k, dim=-1, sorted=False)[1]
        weights = probs.gather(1, ids)
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=self.norm_min)
        return weights.to(x.dtype), ids


# expert scores from router logits, by a config's `scoring_func` (transformers' activations
# name no softmax, so a config cannot choose it there either)
SCORES = {"sqrtsoftplus": lambda logits: F.softplus(logits).sqrt(), "sigmoid": torch.sigmoid}


def _score_fn(scoring: str):
    if scoring not in SCORES:
        raise ValueError(f"unknown expert scoring {scoring!r} (one of {sorted(SCORES)})")
    return SCORES[scoring]


class ScoredTopK(Router):
    """DeepSeek-V4 routing, in the hidden dtype as its reference computes it: scores =
    f(logits) (√softplus or sigmoid); experts chosen by score plus a correction
    bias; the weights the chosen plain scores, always renormalised, times `routed_scaling`."""

    def __init__(
        self, hidden: int, num_experts: int, top_k: int, scoring: str, routed_scaling: float
    ):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts))
        self.top_k, self.score, self.routed_scaling = top_k, _score_fn(scoring), routed_scaling

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.score(F.linear(x, self.weight))  # [T, E]
        choice = scores + self.e_score_correction_bias.float()
        ids = torch.topk(choice, self.top_k, dim=-1, sorted=False)[1]
        return _renormalised(scores.gather(1, ids), self.routed_scaling, x.dtype), ids


class HashRouter(Router):
    """Routing by token id (DeepSeek-V4's first layers): a fixed table [V, k] names each
    token's experts, and the scores f(logits) only weight them, renormalised and scaled as
    ScoredTopK's."""

    by_token = True

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        vocab: int,
        scoring: str,
        routed_scaling: float,
    ):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))
        # integer, so the loader keeps its dtype; a parameter so it loads with the weights
        self.tid2eid = nn.Parameter(
            torch.zeros(vocab, top_k, dtype=torch.long), requires_grad=False
        )
        self.top_k, self.score, self.routed_scaling = top_k, _score_fn(scoring), routed_scaling

    def forward(
        self, x: torch.Tensor, token_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.score(F.linear(x, self.weight))  # [T, E]
        ids = self.tid2eid[token_ids]  # [T, k]
        return _renormalised(scores.gather(1, ids), self.routed_scaling, x.dtype), ids


def _renormalised(w: torch.Tensor, scaling: float, dtype: torch.dtype) -> torch.Tensor:
    return (w / (w.sum(dim=-1, keepdim=True) + 1e-20) * scaling).to(dtype)
