"""The expert-backend contract: what the runtime asks of whatever serves a model's experts.

One backend serves every MoE layer of one model (the `Experts` op of each layer calls it).
The engine, the CUDA-graph capture, the runner's service and the benchmarks reach a
backend only through these methods; the offload backend (moe/offload.py) and the
distributed one (dist/experts.py) implement all of them.
"""

from __future__ import annotations

import abc
from collections.abc import Hashable

import torch
from torch import nn

from freetoken.layers.moe import Experts, Router, SparseMoeBlock
from freetoken.weights import WeightsError

__all__ = ["ExpertBackend", "ExpertsOps", "attach", "routers_of"]


class ExpertBackend(abc.ABC):
    # --- inside a step ------------------------------------------------------------------
    @abc.abstractmethod
    def __call__(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Σ_j weights[t, j] · expert[ids[t, j]](x[t]) for x [T, H], ids/weights [T, k]."""

    @abc.abstractmethod
    def device_only(self, layer: int, tokens: int = 1) -> bool:
        """Whether a step of `tokens` tokens runs this layer with no host work, so it can
        stay inside a CUDA graph (else the capture is cut at the layer)."""

    @abc.abstractmethod
    def account_device(self, layer: int, routes: int) -> None:
        """Counts a layer run inside a graph, at each replay (a capture counts nothing)."""

    @abc.abstractmethod
    def use_routers(self, routers: dict[int, Router]) -> None:
        """The model's router of each MoE layer, given once at attach: a backend may guess a
        layer's experts ahead of its call with them (a guess never replaces the call's
        routes)."""

    # --- between steps ------------------------------------------------------------------
    @abc.abstractmethod
    def between_steps(self, tokens: int) -> None:
        """Called before every step of `tokens` tokens: placement changes and the hand-over
        of the cache's books happen here, never inside a step."""

    @property
    @abc.abstractmethod
    def generation(self) -> Hashable:
        """Changes whenever tensors a captured step reads move (a resize, whole layers placed
        or released): graphs captured under another generation are dropped and redone."""

    @property
    @abc.abstractmethod
    def variant(self) -> Hashable:
        """How a step is captured over the same tensors (a decode placement: where its graphs
        are cut, what each layer launches): within a generation each variant's graphs are
        kept apart, so a move back to one replays what it captured before."""

    @abc.abstractmethod
    def keep_books_on_host(self) -> bool:
        """Stops keeping the cache's books on the device, for good (a capture failed with
        them there); True if anything changed."""

    @abc.abstractmethod
    def wait_step(self) -> None:
        """Waits until the step's device work is done (asleep where a CPU lane needs the cores)."""

    @property
    @abc.abstractmethod
    def waits_asleep(self) -> bool:
        """Whether a thread waiting for the device should sleep rather than spin (a CPU
        lane's workers need the cores)."""

    # --- the expert cache ---------------------------------------------------------------
    @property
    @abc.abstractmethod
    def capacity(self) -> int:
        """Slots of the GPU expert cache (per GPU); 0 without a cache."""

    @property
    @abc.abstractmethod
    def expert_bytes(self) -> int:
        """Bytes of one expert over every bank: what one slot holds."""

    @property
    @abc.abstractmethod
    def floor(self) -> int:
        """The fewest slots a resize may leave."""

    @abc.abstractmethod
    def resize(self, slots: int) -> dict:
        """Grows or shrinks the slot pool between steps; ValueError where it cannot."""

    @abc.abstractmethod
    def warm(self, seed: int = 0) -> None:
        """Fills every free slot (benchmarks start from a full cache)."""

    # --- memory and statistics ----------------------------------------------------------
    @property
    @abc.abstractmethod
    def host_bytes(self) -> int:
        """Host memory of the expert banks (all of the model's experts, held once)."""

    @property
    def vram_elsewhere(self) -> int:
        """GPU memory this backend holds outside this process (other ranks' GPUs)."""
        return 0

    @abc.abstractmethod
    def counters(self) -> dict:
        """This process's routed work and host timers (bench rows are their differences)."""

    @abc.abstractmethod
    def stats(self) -> dict:
        """Policy, counters, cache and path statistics, as /stats and /api/cache show them."""

    @abc.abstractmethod
    def idle(self) -> None:
        """Called when the engine has no work."""

    @abc.abstractmethod
    def close(self) -> None:
        """Frees what the backend can give back without losing the model."""


class ExpertsOps:
    """The `Experts` ops of one model's MoE layers, found once: what serves them now, and
    the means to put something else in front of it (a CUDA-graph capture does)."""

    def __init__(self, model: nn.Module):
        self.modules = [m for m in model.modules() if isinstance(m, Experts)]

    @property
    def backend(self) -> ExpertBackend | None:
        """The backend every MoE layer calls (None for a model without MoE layers, or before
        the loader installed one). `attach` installs one backend for every layer."""
        if not self.modules or self.modules[0].backend is None:
            return None
        backend = self.modules[0].backend
        if not isinstance(backend, ExpertBackend):
            raise TypeError(f"the experts op is a {type(backend).__name__}, not an ExpertBackend")
        return backend

    def route_through(self, op) -> list:
        """Makes `op` every layer's experts op; returns what to give `restore`."""
        saved = [(m, m.backend) for m in self.modules]
        for m in self.modules:
            m.backend = op
        return saved

    @staticmethod
    def restore(saved: list) -> None:
        for m, backend in saved:
            m.backend = backend


def attach(model: nn.Module, backend: ExpertBackend, layers: list[int]) -> None:
    """Makes `backend` the experts op of every MoE layer of the model; `layers` are the
    layers the backend holds experts for."""
    for m in ExpertsOps(model).modules:
        if m.layer not in layers:
            raise WeightsError(f"checkpoint has no experts for layer {m.layer}")
        m.backend = backend
    backend.use_routers(routers_of(model))


def routers_of(model: nn.Module) -> dict[int, Router]:
    """The router of each MoE layer built as a `SparseMoeBlock`, by its experts' layer."""
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    return {b.experts.layer: b.gate for b in blocks}
