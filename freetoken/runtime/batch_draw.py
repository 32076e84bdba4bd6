"""A decode step's tokens, rows with the same options drawn together.

On a GPU one row's draw is a handful of launches (penalties, a uniform, two top-k kernels):
0.2-0.4 ms of the engine thread a row on an H200, which at four streams adds up to a large
part of a step. Rows whose options are the same (clients send the same ones, or none) and
whose draw takes the kernels, or is greedy, are drawn as one batch: the penalties counted
in one scatter over the batch, the kernels launched once over its rows. Every other row is
drawn alone by `sampling.draw`. A row draws the same token either way: the same arithmetic a
logit, and a seeded row's uniform from its own generator, one a step, as alone.
"""

from __future__ import annotations

import torch

from freetoken.kernels import sample_gpu
from freetoken.layers import fused
from freetoken.runtime import sampling
from freetoken.runtime.sampling import SamplingParams

__all__ = ["draw_rows"]


def _options(p: SamplingParams) -> tuple:
    """What a draw depends on, besides the row's own history and generator."""
    return (
        p.temperature,
        p.top_k,
        p.top_p,
        p.min_p,
        p.repeat_penalty,
        p.repeat_last_n,
        p.presence_penalty,
        p.frequency_penalty,
    )


def _batches(scores: torch.Tensor, p: SamplingParams) -> bool:
    if p.greedy:
        return True
    V = scores.shape[-1]
    return scores.is_cuda and fused.ENABLED and 0 < p.top_k <= min(sample_gpu.MAX_K, V - 1)


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
    groups: dict[tuple, list[int]] = {}
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
        batch = _penalize(batch, [histories[j] for j in members], p, num_ctx)
        tokens = _draw_batch(batch, p, [generators[j] for j in members])
        for i, j in enumerate(members):
            out[j] = tokens[i]
    return out  # type: ignore[return-value]


def _penalize(
    batch: torch.Tensor, histories: list[list[int]], p: SamplingParams, num_ctx: int
) -> torch.Tensor:
    """`sampling.apply_penalties` on each row, as one scatter over the batch (the same
    logits as each row's own path, on either device)."""
    if not sampling.penalized(p):
        return batch
    n = num_ctx if p.repeat_last_n < 0 else p.repeat_last_n
    B, V = batch.shape
    flat = [r * V + t for r, h in enumerate(histories) for t in (h[-n:] if n else [])]
    ids = torch.tensor(flat, dtype=torch.long)
    if batch.is_cuda:
        # pinned: a copy from pageable memory waits for the stream (the step launched ahead)
        ids = ids.pin_memory().to(batch.device, non_blocking=True)
    counts = torch.zeros(B * V, dtype=batch.dtype, device=batch.device)
    counts.index_add_(0, ids, torch.ones_like(ids, dtype=batch.dtype))
    return sampling.penalize_counts(batch, counts.view(B, V), p)


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
    return sample_gpu.top_k_draw(batch.contiguous(), p.top_k, p.temperature, p.top_p, p.min_p, u)
