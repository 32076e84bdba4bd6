"""Recurrent state slots: the per-sequence state of a hybrid model's recurrent layers.

A recurrent layer (`KVLayout` kind `recurrent`, a Gated DeltaNet) keeps no per-token entry
that pages could hold: each sequence has a fixed-size state in every such layer, a conv
state and a recurrent state (`KVLayout.state`, in that order). The pool holds a fixed
number of slots, each with every recurrent layer's two states; a sequence takes a slot
when it is admitted and gives it back when it finishes or is preempted, so a preempted
sequence restarts from zero state and its tokens are computed again. The slot a sequence
holds travels in each step's `StepContext.state_slots`.

The recurrent state is kept in fp32 whatever the model's dtype (it accumulates over the
whole sequence); the conv state, a few raw inputs, in the model's dtype.
"""

from __future__ import annotations

import torch

from freetoken.layers.context import StateStore
from freetoken.models.base import KVLayout


class OutOfSlots(RuntimeError):
    """Every state slot is held by a sequence."""


class StateCache(StateStore):
    """conv[layer] [num_slots, *conv shape] (model dtype) and recurrent[layer]
    [num_slots, *recurrent shape] (fp32) for recurrent layers, None for the others."""

    def __init__(
        self,
        layout: list[KVLayout],
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.layout, self.num_slots = layout, num_slots

        def states(i: int, dt: torch.dtype) -> list[torch.Tensor | None]:
            return [
                torch.zeros((num_slots, *lay.state[i]), dtype=dt, device=device)
                if lay.kind == "recurrent"
                else None
                for lay in layout
            ]

        self.conv = states(0, dtype)
        self.recurrent = states(1, torch.float32)
        # pop() from the end hands out low slots first
        self.free_list = list(range(num_slots - 1, -1, -1))

    @classmethod
    def for_layout(
        cls, layout: list[KVLayout], num_slots: int, dtype: torch.dtype, device: torch.device
    ) -> StateCache | None:
        """The pool for a model's `kv_layout()`, or None when no layer is recurrent."""
        if not any(lay.kind == "recurrent" for lay in layout):
            return None
        return cls(layout, num_slots, dtype, device)

    @staticmethod
    def slot_bytes(layout: list[KVLayout], dtype: torch.dtype) -> int:
        """Bytes one sequence's state takes over every recurrent layer."""
        size = torch.tensor([], dtype=dtype).element_size()
        total = 0
        for lay in layout:
            if lay.kind == "recurrent":
                conv, rec = (_numel(s) for s in lay.state)
                total += conv * size + rec * 4
        return total

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors())

    @property
    def num_free(self) -> int:
        return len(self.free_list)

    def alloc(self, init: list[torch.Tensor] | None = None) -> int:
        """A free slot, its states zeroed (the state of a sequence with nothing cached), or
        set from `init`, a `snapshot` (a sequence resumed from an anchor)."""
        if not self.free_list:
            raise OutOfSlots(f"all {self.num_slots} state slots are held")
        slot = self.free_list.pop()
        for i, t in enumerate(self._tensors()):
            if init is None:
                t[slot].zero_()
            else:
                t[slot].copy_(init[i])
        return slot

    def snapshot(self, slot: int) -> list[torch.Tensor]:
        """Host copies of one slot's states, every recurrent layer's, for `alloc(init=)`."""
        return [t[slot].to("cpu", copy=True) for t in self._tensors()]

    def save(self, slots: torch.Tensor) -> list[torch.Tensor]:
        """Copies of the states in `slots`, every layer's, for `restore`."""
        return [t[slots] for t in self._tensors()]

    def restore(self, slots: torch.Tensor, saved: list[torch.Tensor]) -> None:
        for t, kept in zip(self._tensors(), saved):
            t[slots] = kept

    def _tensors(self) -> list[torch.Tensor]:
        return [t for t in self.conv + self.recurrent if t is not None]

    def free(self, slot: int) -> None:
        if slot in self.free_list or not 0 <= slot < self.num_slots:
            raise ValueError(f"state slot {slot} is not held")
        self.free_list.append(slot)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
