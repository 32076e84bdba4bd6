"""Plain-torch reference kernels: the definition every fast kernel is tested against.

Expert banks are a mapping of bank name to tensor, as `ExpertSpec.banks` names them:
gate_up [E, 2I, H] (gate rows first), down [E, H, I], and with biases gate_up_bias [E, 2I]
and down_bias [E, H]. The spec (models/base.py) says what each expert computes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:  # kernels sit below models: the spec is read, never built, here
    from freetoken.models.base import ExpertSpec

Banks = Mapping[str, torch.Tensor]


def activate(gate: torch.Tensor, up: torch.Tensor, spec: ExpertSpec) -> torch.Tensor:
    """The expert's hidden activation from its gate and up projections."""
    if spec.activation == "silu":
        return F.silu(gate) * up
    gate = gate.clamp(max=spec.limit)
    up = up.clamp(min=-spec.limit, max=spec.limit)
    if spec.activation == "silu_clamped":
        return F.silu(gate) * up
    return (up + 1) * gate * torch.sigmoid(gate * spec.alpha)


def expert_ffn(x: torch.Tensor, w: Banks, spec: ExpertSpec) -> torch.Tensor:
    """One expert over x [n, H]; `w` holds that expert's rows of each bank."""
    gate, up = F.linear(x, w["gate_up"], w.get("gate_up_bias")).chunk(2, dim=-1)
    return F.linear(activate(gate, up, spec), w["down"], w.get("down_bias"))


def moe_experts(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, banks: Banks, spec: ExpertSpec
) -> torch.Tensor:
    """Σ_j weights[t, j] · expert[ids[t, j]](x[t]) over `banks` indexed by `ids`.

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
        y = expert_ffn(x[tok], {b: t[e].to(x.dtype) for b, t in banks.items()}, spec)
        out.index_add_(0, tok, y * weights.reshape(-1)[sel, None].to(x.dtype))
    return out
