"""Routing modes for decode benchmarks.

random-tokens: a random token id is fed at every step (as llama-bench's tg does);
generated:     the model's own greedy tokens from a fixed prompt;
trace:         a replayed synthetic trace with locality: per layer, each of the top-k
               experts is kept from the previous token's set with probability `reuse`,
               else drawn from a Zipf(`zipf`) law over a fixed random permutation of the
               experts (published Qwen3-30B-A3B traces: ~45% reuse by the next token);
uniform:       every step draws k distinct experts uniformly (no locality: the worst case for
               any cache, hit rate = cached fraction).
"""

from __future__ import annotations

import numpy as np
import torch

from freetoken.layers.moe import Router

MODES = ("random-tokens", "generated", "trace", "uniform")


class Trace:
    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        k: int,
        reuse: float = 0.45,
        zipf: float = 1.1,
        seed: int = 0,
    ):
        self.E, self.k, self.reuse, self.zipf = num_experts, k, reuse, zipf
        self.rng = np.random.default_rng(seed)
        ranks = np.arange(1, num_experts + 1, dtype=np.float64)
        p = ranks**-zipf if zipf > 0 else np.ones(num_experts)
        self.p = p / p.sum()
        self.cdf = np.cumsum(self.p)
        self.perm = [self.rng.permutation(num_experts) for _ in range(num_layers)]
        self.prev: dict[int, np.ndarray] = {}

    def params(self) -> dict:
        return {"reuse": self.reuse, "zipf": self.zipf, "experts": self.E, "k": self.k}

    def next(self, layer: int) -> np.ndarray:
        prev = self.prev.get(layer)
        chosen: list[int] = []
        if prev is not None:
            chosen = prev[self.rng.random(len(prev)) < self.reuse].tolist()
        while len(chosen) < self.k:
            # draw a handful at once (inverse CDF): the benchmark's own cost must stay small
            draws = np.searchsorted(self.cdf, self.rng.random(2 * self.k))
            for e in self.perm[layer][np.minimum(draws, self.E - 1)].tolist():
                if e not in chosen:
                    chosen.append(e)
                    if len(chosen) == self.k:
                        break
        ids = np.array(chosen, dtype=np.int64)
        self.prev[layer] = ids
        return ids


class RouteTable:
    """A trace's routes for `steps` tokens, on the device, read at a cursor.

    The routers read the table at the cursor with device ops only, so the decode step stays
    capturable in CUDA graphs and the benchmark adds no host work inside a layer; the
    benchmark advances the cursor once per step (`advance`).
    """

    def __init__(self, trace: Trace, num_layers: int, steps: int, device: torch.device):
        table = np.stack(
            [np.stack([trace.next(layer) for layer in range(num_layers)]) for _ in range(steps)]
        )
        self.steps = steps
        self.per_layer = [
            torch.from_numpy(np.ascontiguousarray(table[:, layer])).to(device)
            for layer in range(num_layers)
        ]  # [steps, k] each
        self.cursor = torch.zeros(1, dtype=torch.long, device=device)

    def rows(self, layer: int, tokens: int) -> torch.Tensor:
        idx = (self.cursor + torch.arange(tokens, device=self.cursor.device)) % self.steps
        return self.per_layer[layer].index_select(0, idx)

    def advance(self, tokens: int) -> None:
        self.cursor.add_(tokens).remainder_(self.steps)


def install_trace(
    model: torch.nn.Module, trace: Trace, num_layers: int, device: torch.device, steps: int = 2048
) -> RouteTable:
    """Routers pick the trace's experts; weights are the router's own softmax at those experts
    (a router that chooses by token id is given the ids, and the trace decides instead)."""
    table = RouteTable(trace, num_layers, steps, device)
    layer_of = {}
    for name, m in model.named_modules():
        if isinstance(m, Router):
            layer_of[id(m)] = int(name.split(".")[2])

    def forward(self: Router, x: torch.Tensor, token_ids: torch.Tensor | None = None):
        logits = torch.nn.functional.linear(x.float(), self.weight.float())  # an fp32 gate too
        probs = torch.softmax(logits, dim=-1)
        ids = table.rows(layer_of[id(self)], x.shape[0])
        w = torch.gather(probs, 1, ids)
        return (w / w.sum(dim=-1, keepdim=True)).to(x.dtype), ids

    for m in model.modules():
        if isinstance(m, Router):
            m.forward = forward.__get__(m, Router)
    return table


def uninstall(model: torch.nn.Module) -> None:
    """Routers route by their own weights again."""
    for m in model.modules():
        if isinstance(m, Router) and "forward" in m.__dict__:
            del m.forward
