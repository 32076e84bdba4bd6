"""The expert policies a model can be served with, and adaptive's decode placements.

A policy says how misses of the GPU expert cache are served; each is one member here with
the facts the backend acts on, so no code compares policy names.
"""

from __future__ import annotations

import enum

__all__ = ["POLICIES", "Mode", "Policy"]


class Policy(enum.StrEnum):
    ADAPTIVE = "adaptive"  # the split of misses, and the placement, chosen by measurement
    RESIDENT = "resident"  # every expert in a slot
    LRU_PCIE = "lru-pcie"  # every miss fetched over PCIe
    CPU_MISSES = "cpu-misses"  # every miss computed on the CPU (through the lane: split at 0)
    STATIC_LAYERS = "static-layers"  # whole layers on the CPU, the rest fixed on the GPU

    @classmethod
    def parse(cls, name: str) -> Policy:
        try:
            return cls(name)
        except ValueError:
            raise ValueError(
                f"unknown MoE policy {name!r} (choose from {', '.join(POLICIES)})"
            ) from None

    @property
    def fixed(self) -> bool:
        """Placement is decided once for the cache's size (at install and at each resize)."""
        return self in (Policy.RESIDENT, Policy.STATIC_LAYERS)

    @property
    def device_books(self) -> bool:
        """Decode steps may keep the cache's books on the device."""
        return self in (Policy.LRU_PCIE, Policy.ADAPTIVE)

    @property
    def streams_prefill(self) -> bool:
        """Long prefill chunks stream whole layers through two buffers of the pool."""
        return self in (Policy.ADAPTIVE, Policy.LRU_PCIE, Policy.CPU_MISSES)

    @property
    def uses_cpu(self) -> bool:
        """Misses of a cached layer may run on the CPU (the host needs their activations)."""
        return self in (Policy.ADAPTIVE, Policy.CPU_MISSES)

    @property
    def fetches_every_miss(self) -> bool:
        return self in (Policy.LRU_PCIE, Policy.RESIDENT, Policy.STATIC_LAYERS)


POLICIES: tuple[str, ...] = tuple(p.value for p in Policy)


class Mode(enum.StrEnum):
    """How adaptive places the experts for decode steps (chooser.ModeChooser measures them):

    cache   every layer through the cache, its books on the host, misses split between
            PCIe and the CPU;
    device  every layer through the cache, its books on the device, every miss fetched by
            a GPU kernel (no host work in a step: one CUDA graph);
    split   books on the device, a tuned share of each layer's misses fetched while the CPU
            computes the others;
    layers  whole layers on the CPU, the rest fixed on the GPU (llama.cpp's --n-cpu-moe).
    """

    CACHE = "cache"
    DEVICE = "device"
    SPLIT = "split"
    LAYERS = "layers"

    @property
    def books_on_device(self) -> bool:
        return self in (Mode.DEVICE, Mode.SPLIT)

    @property
    def moves_layers(self) -> bool:
        """Whether entering or leaving it moves whole layers' experts (at times hundreds of
        milliseconds, the cache emptied): no batch size serves it apart from the others."""
        return self is Mode.LAYERS


def measured_modes(
    layers: int, experts: int, capacity: int, device_books: bool, lane: bool
) -> tuple[Mode, ...] | None:
    """The placements adaptive measures for a cache of `capacity` experts, with the cache's
    books kept on the device or not, and with the CPU lane or not (None where the cache
    holds every expert). With the lane, split does what the host-kept cache does without a
    host round trip a layer, so the latter is not measured."""
    if capacity >= layers * experts:
        return None
    if device_books and lane:
        return (Mode.DEVICE, Mode.SPLIT, Mode.LAYERS)
    if device_books:
        return (Mode.DEVICE, Mode.SPLIT, Mode.CACHE, Mode.LAYERS)
    return (Mode.CACHE, Mode.LAYERS)
