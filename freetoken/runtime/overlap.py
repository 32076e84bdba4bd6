"""Decode steps launched one ahead: the host's work on a step's tokens overlaps the next step.

At batch one a served decode step is a captured graph of a few milliseconds, and after it
the engine thread detokenizes, matches stops, streams the text and plans the next step,
all while the GPU waits. When the next step is known before the tokens are read (the same
sequences, one token each, the token it feeds still on the device), the engine launches it
first and reads the tokens after: the GPU runs step k+1 while the host finishes step k.

What makes a sequence safe to run ahead is that nothing its next step needs comes from the
host's reading of this one: no grammar mask (computed from the accepted token), no penalty
over its history, no logprobs (read from scores the next step overwrites), no recurrent
state (a step run past the sequence's end would move it on), and room left for one more
token. A sequence that ends while its next step is in flight loses only that step's token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from freetoken.runtime import sampling
from freetoken.runtime.sequence import Sequence

__all__ = ["Ahead", "Readback", "runs_ahead"]


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
    """A decode step launched before the last one's tokens were read: its sequences (in
    order), each row's scores and drawn token on the device, and their readback."""

    seqs: list[Sequence]
    drawn: list[torch.Tensor]
    scores: list[torch.Tensor]
    readback: Readback
    t0: int = field(default_factory=time.perf_counter_ns)


def runs_ahead(seq: Sequence, num_ctx: int, taking: int = 1) -> bool:
    """Whether the sequence's next decode step may launch before the host reads its tokens;
    `taking`: tokens it will have accepted by then, beyond those it holds now."""
    return (
        seq.constraint is None
        and seq.top_logprobs is None
        and seq.state_slot is None
        and not sampling.penalized(seq.params)
        and len(seq.output_ids) + taking < seq.max_new_tokens
        and seq.num_tokens + taking < num_ctx
    )
