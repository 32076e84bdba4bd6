"""Buffers computed from a layer's settings rather than loaded (rotary frequencies).

Models are built on the meta device, so such buffers exist only as shapes until the loader
asks every layer that declares them to compute them on the real device.
"""

from __future__ import annotations

import abc

from torch import nn


class ComputedBuffers(nn.Module, abc.ABC):
    @abc.abstractmethod
    def reset_buffers(self) -> None:
        """Computes the buffers in place (a no-op while they are still on the meta device)."""


def reset_buffers(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, ComputedBuffers):
            m.reset_buffers()
