"""A decode step's tokens, rows with the same options drawn together.

On a GPU one row's draw is a handful of launches (penalties, a uniform, the draw's kernels):
0.2-0.4 ms of the engine thread a row on an H200, which at four streams adds up to a large
part of a step. Rows whose options are the same (clients send the same ones, or none) and
whose draw takes the kernels, or is greedy, are drawn as one batch: the penalties counted
in one scatter over the batch, the kernels launched once over its rows. Every other row is
drawn alone by `sampling.draw`. A row draws the same token either way: the same arithmetic a
logit, and a seeded row's uniform from its own generator, one a step, as alone.
"""

from __future__ import annotations

import dataclasses

import torch

from freetoken.kernels import sample_gpu
from freetoken.layers import fused
from freetoken.runtime import sampling
from freetoken.runtime.sampling import SamplingParams

__all__ = ["draw_rows"]


def _options(p: SamplingParams) -> SamplingParams:
    """What a draw depends on, besides the row's own history and generator: the options
    with those that do not change a draw cleared (a field added later counts by default)."""
    return dataclasses.replace(p, seed=-1, num_predict=-1, stop=())


def _batches(scores: torch.Tensor, p: SamplingParams) -> bool:
    if p.greedy:
        return True
    V = scores.shape[-1]
    return scores.is_cuda and fused.ENABLED and sample_gpu.takes(p.top_k, V, p.top_p)


def draw_rows(
    scores: torch.Tensor,
    rows: list[int],
    histories: list[list[int]],
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    num_ctx: int,
) -> list[torch.Tensor]:
    """A token (0-d, on the scores' device; nothing waits for it) for each of `rows` of fp32
    scores [B, V], each with its history (read for penalties), options and generator."""
    groups: dict[object, list[int]] = {}
    for j, p in enumerate(params):
        groups.setdefault(_options(p) if _batches(scores, p) else ("alone", j), []).append(j)
    out: list[torch.Tensor | None] = [None] * len(rows)
    for members in groups.values():
        p = params[members[0]]
        if len(members) == 1 or not _batches(scores, p):
            for j in members:
                out[j] = sampling.draw(
                    scores[rows[j]], histories[j], params[j], num_ctx, generators[j]
                )
            continue
        picked = [rows[j] for j in members]
        # every row in order is the tensor itself; a subset is stacked on the device (a
        # host index list would be copied from pageable memory, which waits for the stream)
        whole = picked == list(range(scores.shape[0]))
        batch = scores.float() if whole else torch.stack([scores[r] for r in picked]).float()
        if sampling.penalized(p):
            batch = sampling.penalize_rows(batch, [histories[j] for j in members], p, num_ctx)
        tokens = _draw_batch(batch, p, [generators[j] for j in members])
        for i, j in enumerate(members):
            out[j] = tokens[i]
    return out  # type: ignore[return-value]


def _draw_batch(
    batch: torch.Tensor, p: SamplingParams, generators: list[torch.Generator | None]
) -> torch.Tensor:
    if p.greedy:
        return torch.argmax(batch, dim=-1)
    dev = batch.device
    if any(g is not None for g in generators):  # a seeded row takes one uniform of its own
        u = torch.cat([torch.rand(1, device=dev, generator=g) for g in generators])
    else:
        u = torch.rand(len(generators), device=dev)
    return sample_gpu.draw(batch.contiguous(), p.top_k, p.temperature, p.top_p, p.min_p, u)
