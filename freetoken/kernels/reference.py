"""Plain-torch reference kernels: the definition every fast kernel is tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def expert_ffn(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """One SwiGLU expert. x: [n, H]; gate_up: [2I, H] (gate rows first); down: [H, I]."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


def moe_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """Σ_j weights[t, j] · expert[ids[t, j]](x[t]) for banks gate_up [E, 2I, H], down [E, H, I].

    Each routed expert runs once over the tokens that chose it; accumulation is in the
    dtype of x (fp32 for fp32 models), in the order the experts are visited.
    """
    out = torch.zeros_like(x)
    flat_ids = ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    experts, counts = torch.unique_consecutive(flat_ids[order], return_counts=True)
    k = ids.shape[1]
    start = 0
    for e, n in zip(experts.tolist(), counts.tolist()):
        sel = order[start : start + n]
        start += n
        tok = sel // k
        y = expert_ffn(x[tok], gate_up[e].to(x.dtype), down[e].to(x.dtype))
        out.index_add_(0, tok, y * weights.reshape(-1)[sel, None].to(x.dtype))
    return out
