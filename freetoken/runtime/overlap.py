"""Decode steps launched one ahead: the host's work on a step's tokens overlaps the next step.

At batch one a served decode step is a captured graph of a few milliseconds, and after it
the engine thread reads the tokens back, detokenizes, matches stops, streams the text and
plans the next step, all while the GPU would wait. The next step's forward pass needs only
the tokens it feeds, which are on the device as soon as they are drawn: when the next step
is the same sequences, one token each, the engine launches its forward pass first and reads
the tokens after, so the GPU runs step k+1 while the host takes step k's tokens.

Step k+1's own tokens are drawn when it lands, after the host has taken step k's: a
grammar's mask and a penalty over the history follow the token just taken, and the mask is
computed while the forward pass runs. Only a sequence with recurrent state never runs ahead
(a step run past its end would move its state on), nor one with no room for another token.
A sequence that ends while a step is ahead loses that step's row, nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from freetoken.runtime.sequence import Sequence

if TYPE_CHECKING:
    from freetoken.runtime.graphs import DecodeGraphs
    from freetoken.runtime.scheduler import Scheduler

__all__ = ["Ahead", "Readback", "refusal", "runs_ahead"]


class Readback:
    """A step's drawn tokens on their way to the host: queued behind the step on its stream,
    so launching more work does not wait for them. `sleep`: wait asleep, not spinning (where
    a CPU lane needs the cores)."""

    def __init__(self, drawn: list[torch.Tensor], sleep: bool = False):
        self.event: torch.cuda.Event | None = None
        if not drawn:
            self.host: torch.Tensor | None = None
            return
        tokens = torch.stack(drawn)
        if not tokens.is_cuda:
            self.host = tokens
            return
        self.host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        self.host.copy_(tokens, non_blocking=True)
        self.event = torch.cuda.Event(blocking=sleep)
        self.event.record()

    def wait(self) -> list[int]:
        """The tokens, once the device has drawn them."""
        if self.host is None:
            return []
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


@dataclass(eq=False)
class Ahead:
    """A decode step's forward pass launched before the last step's tokens were read: its
    sequences, in order, and the graph's logits they will draw from (valid until the next
    step is launched)."""

    seqs: list[Sequence]
    logits: torch.Tensor


def runs_ahead(seq: Sequence, num_ctx: int, taking: int = 1) -> bool:
    """Whether the sequence's next decode step may launch before the host reads its tokens;
    `taking`: tokens it will have accepted by then, beyond those it holds now."""
    return len(seq.output_ids) + taking < seq.max_new_tokens and seq.num_tokens + taking < num_ctx


def refusal(
    seqs: list[Sequence], queued: bool, scheduler: Scheduler, graphs: DecodeGraphs, num_ctx: int
) -> str | None:
    """Why the next decode step of `seqs` may not launch ahead (None where it may): the
    engine counts the reasons, since a server that never runs ahead shows only a lower rate.
    `queued`: a call or a request waits in the engine's inbox. Reserves the step's pages
    where it may."""
    B, ctx_len = len(seqs), max(seq.num_cached + 1 for seq in seqs)
    if queued:
        return "queued"
    if scheduler.waiting or len(scheduler.running) != B:
        return "batch"  # the batch changes at the next step
    if any(seq.state_slot is not None for seq in seqs):
        # a step ahead moves the recurrent state in place, past a token that may end the
        # sequence (and anchors keep the state a sequence ends with)
        return "state"
    if not all(runs_ahead(seq, num_ctx) for seq in seqs):
        return "ending"
    if not graphs.fits(B, ctx_len):
        return "shape"
    if not graphs.uncut(B, ctx_len):
        return "cut"
    if not all(scheduler.reserve(seq, 1) for seq in seqs):
        return "pages"
    return None
