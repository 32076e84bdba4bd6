"""Embeddings: the mean of the model's final hidden states over a text's tokens.

`mean_hidden` runs on the engine thread between steps (`Engine.call_between_steps`), with
pages borrowed from the KV pool (and, for a model with recurrent layers, a state slot) for
the forward and given back at once, so an embedding never races a decoding step and never
holds memory after it returns.
"""

from __future__ import annotations

import torch

from freetoken.layers.context import SeqSpan, StepContext, step_context
from freetoken.runtime.engine import Engine

__all__ = ["mean_hidden", "normalize"]


@torch.inference_mode()
def mean_hidden(engine: Engine, ids: list[int], chunk: int) -> torch.Tensor | None:
    """fp32 [H] mean of the final hidden states over `ids`, run in prefill chunks; None when
    the KV pool has too few free pages right now, or every state slot is held (the caller
    retries after a step)."""
    kv, dev, state = engine.kv, engine.device, engine.state
    need = kv.pages_for(len(ids))
    if not engine.scheduler.make_room(need) or (state is not None and not state.num_free):
        return None
    pages = kv.pool.alloc(need)
    slot = state.alloc() if state is not None else None
    try:
        tokens = torch.tensor(ids, device=dev)
        total = None
        for start in range(0, len(ids), chunk):
            n = min(chunk, len(ids) - start)
            ctx_slots = kv.slots_of(pages, 0, start + n, dev)
            ctx = StepContext(
                positions=torch.arange(start, start + n, device=dev),
                slots=ctx_slots[start:],
                seqs=[SeqSpan(0, n, start + n, ctx_slots)],
                kv=kv,
                logits_index=torch.empty(0, dtype=torch.long, device=dev),
                state=state,
                state_slots=None if slot is None else torch.tensor([slot], device=dev),
            )
            with step_context(ctx):
                hidden = engine.model(tokens[start : start + n], ctx.positions)  # [n, H]
            part = hidden.float().sum(dim=0)
            total = part if total is None else total + part
        return (total / len(ids)).cpu()
    finally:
        kv.pool.release(pages)
        if slot is not None:
            state.free(slot)


def normalize(vec: torch.Tensor, dimensions: int | None = None) -> list[float]:
    """The first `dimensions` components (all when None), scaled to unit L2 norm."""
    if dimensions:
        vec = vec[:dimensions]
    norm = torch.linalg.vector_norm(vec)
    return (vec / norm if norm > 0 else vec).tolist()
