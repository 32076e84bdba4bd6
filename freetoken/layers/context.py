"""Per-step batch metadata that attention layers read, set once per forward.

A step runs a flat batch of T tokens drawn from several sequences (prefill chunks and
decode tokens alike). Layers find where each token's K/V goes and which cached K/V each
sequence attends to here, instead of through every forward signature.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

__all__ = [
    "DecodeView",
    "KVStore",
    "SeqSpan",
    "StateStore",
    "StepContext",
    "current",
    "step_context",
]


class KVStore:
    """The paged KV pool as flat slot arrays: k[layer] / v[layer] are
    [num_slots, kv_heads, head_dim]; index[layer] and inputs[layer], where a layer keeps
    them, an indexer key and a compressor's inputs per row (runtime/kv_cache.py)."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    index: list[torch.Tensor | None]
    inputs: list[torch.Tensor | None]
    page_size: int


class StateStore:
    """Per-sequence recurrent state in fixed slots: conv[layer] [num_slots, *conv shape] and
    recurrent[layer] [num_slots, *recurrent shape] for recurrent layers, None elsewhere. A
    slot holds a sequence's state after the tokens it has cached."""

    conv: list[torch.Tensor | None]
    recurrent: list[torch.Tensor | None]


@dataclass(slots=True)
class SeqSpan:
    q_start: int  # first token of this sequence in the step's flat batch
    q_len: int  # tokens of this sequence in the step
    ctx_len: int  # tokens of context after this step (cached + new)
    ctx_slots: torch.Tensor  # [ctx_len] slot of every context token, in order
    # recurrent layers keep a copy of their state after each of these many tokens of the
    # span (anchors inside a prefill chunk: runtime/anchors.py)
    marks: tuple[int, ...] = ()


@dataclass(slots=True)
class DecodeView:
    """A decode step in fixed shapes, so it can be captured once and replayed (CUDA graphs).

    Every one of B sequences feeds one token. Contexts are padded to `max_ctx` tokens and
    masked beyond each sequence's length, so only tensor contents change from step to step.
    """

    block_table: torch.Tensor  # [B, max_ctx // page_size] page of each context position
    lens: torch.Tensor  # [B] context tokens after this step
    page_size: int
    ctx_slots: torch.Tensor | None = None  # [B, max_ctx], from derive()
    mask: torch.Tensor | None = None  # [B, 1, 1, max_ctx], True where a key is visible

    def derive(self) -> None:
        """Slots and mask from the block table and lengths, on the device (capturable)."""
        P = self.page_size
        pos = torch.arange(self.block_table.shape[1] * P, device=self.block_table.device)
        self.ctx_slots = self.block_table[:, pos // P] * P + pos % P
        self.mask = (pos[None, :] < self.lens[:, None])[:, None, None, :]


@dataclass(slots=True)
class StepContext:
    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T] where each new token's K/V is written
    seqs: list[SeqSpan]
    kv: KVStore
    logits_index: torch.Tensor  # [B] tokens whose logits the step needs
    extra: dict = field(default_factory=dict)
    decode: DecodeView | None = None  # set for fixed-shape decode steps; seqs is then unused
    # recurrent layers: the pool, and each sequence's slot in it ([len(seqs)], or [B] with
    # `decode`); None: no state kept, every sequence starts at position 0 in this step
    state: StateStore | None = None
    state_slots: torch.Tensor | None = None
    # filled by recurrent layers: (sequence index, mark) -> {layer: (conv, recurrent) state}
    marked: dict = field(default_factory=dict)


_current: StepContext | None = None


@contextlib.contextmanager
def step_context(ctx: StepContext) -> Iterator[StepContext]:
    global _current
    # NOTE: a nested forward would silently read the outer step's slots; refuse it.
    if _current is not None:
        raise RuntimeError("step_context is already set: forwards must not nest")
    _current = ctx
    try:
        yield ctx
    finally:
        _current = None


def current() -> StepContext:
    if _current is None:
        raise RuntimeError("no step context: run the model through the engine")
    return _current
