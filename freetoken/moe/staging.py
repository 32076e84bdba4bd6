"""Pinned host buffers for the few tensors a layer's host work needs from the GPU."""

from __future__ import annotations

import torch


class Staging:
    """Pinned host buffers a layer's routes, activations and CPU result pass through.

    Copies into them are queued together and waited for once, instead of one blocking
    round trip per tensor; the CPU result goes back to the GPU without a staging copy.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._bufs: dict[tuple, torch.Tensor] = {}
        self._event = torch.cuda.Event()

    def buf(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        key = (name, shape, dtype)
        if key not in self._bufs:
            # not an inference tensor, so code outside inference mode may write it too
            with torch.inference_mode(False):
                self._bufs[key] = torch.empty(shape, dtype=dtype, pin_memory=True)
        return self._bufs[key]

    def clear(self) -> None:
        self._bufs.clear()

    def pull(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """The tensors in host memory, once every copy has landed."""
        out = self.pull_async(*tensors)
        self._event.synchronize()
        return out

    def pull_async(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """Queues the copies and returns their host buffers; `wait` before reading them. Work
        queued after this call runs on while the host waits."""
        out = []
        for i, t in enumerate(tensors):
            host = self.buf(f"in{i}", tuple(t.shape), t.dtype)
            host.copy_(t, non_blocking=True)
            out.append(host)
        self._event.record()
        return out

    def wait(self) -> None:
        self._event.synchronize()


class CopyTimings:
    """Times of queued copies, fed to a cost model as they finish: never waited for."""

    def __init__(self, keep: int = 64):
        self.keep = keep
        self._pending: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []

    def record(self, n: int, start: torch.cuda.Event, end: torch.cuda.Event, cost) -> None:
        """Adds one copy of `n` experts between two timing events; `cost.observe(n, seconds)`
        hears of every copy that has finished by now."""
        self._pending.append((n, start, end))
        waiting = []
        for n, start, end in self._pending:
            if end.query():
                cost.observe(n, start.elapsed_time(end) / 1e3)
            else:
                waiting.append((n, start, end))
        self._pending = waiting[-self.keep :]
