"""Where each MoE layer's experts run during decode, and the moves between placements.

Three kinds of layer: whole on the CPU (`cpu_layers`: no cache, static-layers' first
layers, adaptive's `layers` mode), fixed in slots (`fixed_layers`: resident, the rest of
static-layers; routed on the device with no bookkeeping), and cached (every other layer,
through the LRU slot pool). `version` counts the moves of whole layers, which replace the
tensors captured steps read: CUDA graphs captured before one are redone. A change of mode
alone moves no tensor: graphs are kept by mode and replayed on the way back.
"""

from __future__ import annotations

import numpy as np
import torch

from freetoken.moe.banks import HostBanks
from freetoken.moe.cache import ExpertCache, expert_part
from freetoken.moe.hotset import resident
from freetoken.moe.policy import Mode, Policy


class PlacementState:
    def __init__(self, banks: HostBanks, cache: ExpertCache | None, device: torch.device):
        self.banks, self.cache, self.device = banks, cache, device
        self.cuda = device.type == "cuda"
        self.cpu_layers: set[int] = set(banks.layers) if cache is None else set()
        self.fixed_layers: set[int] = set()
        self.fixed_slots: torch.Tensor | None = None  # [L, E] slot of every fixed expert
        # a change of mode moves no tensor: no new version (graphs are kept by mode)
        self.mode = Mode.CACHE
        self.version = 0
        # what the cache held, by layer (most recent first), when whole layers were placed
        self._held: dict[int, list[int]] | None = None

    def is_cpu(self, layer: int) -> bool:
        return self.cache is None or layer in self.cpu_layers

    # --- moves ----------------------------------------------------------------------------
    def place(self, policy: Policy) -> None:
        """The placement a policy has at the cache's current size. A cached policy whose
        pool holds every expert routes like resident: nothing can miss, so each layer's
        books and fetch (0.92 of resident's rate with device-kept books) would be work for
        nothing; a resize below that releases them."""
        L, E = len(self.banks.layers), self.banks.num_experts
        if policy is Policy.RESIDENT:
            if self.cache.capacity < L * E:
                raise ValueError(
                    f"the resident policy needs {L * E} expert slots "
                    f"({L * E * self.cache.expert_bytes / 2**30:.1f} GiB); the budget gives "
                    f"{self.cache.capacity}"
                )
            self.fix_layers(self.banks.layers)
        elif policy is Policy.STATIC_LAYERS:
            self.place_layers()
        elif self.cache.capacity >= L * E:
            self.fix_layers(self.banks.layers)

    def place_layers(self) -> None:
        """The first layers on the CPU, as many of the last as fit fixed in slots."""
        L, E = len(self.banks.layers), self.banks.num_experts
        fit = min(L, self.cache.capacity // E)
        self.cpu_layers = set(self.banks.layers[: L - fit])
        self.fix_layers(self.banks.layers[L - fit :])

    def fix_layers(self, gpu_layers: list[int]) -> None:
        """Every expert of `gpu_layers` fixed in a slot: those already cached where they are,
        the others copied in."""
        for layer in gpu_layers:
            missing = np.flatnonzero(self.cache.slot_of[layer] < 0)
            if len(missing):
                self.copy_in(layer, missing, self.cache.fix(layer, missing))
            self.cache.fixed[self.cache.slot_of[layer]] = True
        # layers whose experts are all fixed in slots route on the device: no host round trip
        self.fixed_layers = set(gpu_layers)
        self.fixed_slots = torch.from_numpy(self.cache.slot_of.copy()).to(self.device)
        self.version += 1

    def enter_layers(self) -> None:
        """Into adaptive's `layers` mode: the cache's contents are remembered, then the first
        layers go to the CPU and the rest are fixed in slots."""
        self._held = resident(self.cache, list(self.banks.layers))
        self.cache.clear()
        self.place_layers()

    def leave_layers(self) -> None:
        """Out of `layers` mode: every layer through the cache again, holding what it held
        before. Released as they were, the CPU layers had no cached expert and the fixed ones
        all of theirs; a split that computes most misses on the CPU then never refilled them
        (through the server, 6.1 misses a token against 2.1 before a 12-step visit, 0.63 of
        the bound against 0.86)."""
        self.release_layers()
        held, self._held = self._held, None
        if self.cache is not None and held:
            self.cache.keep(held)
            self._restore(held, list(self.banks.layers))

    def release_layers(self) -> None:
        """Back to every layer through the cache; fixed experts stay, as cached ones."""
        if self.cache is not None:
            self.cache.fixed[:] = False
        if self.cpu_layers or self.fixed_layers:
            self.cpu_layers, self.fixed_layers = set(), set()
            self.version += 1

    def copy_in(self, layer: int, experts: np.ndarray, slots: np.ndarray) -> None:
        """Copies experts of `layer` from the host banks into `slots` (queued on a GPU)."""
        for bank, src in self.banks.banks[layer].items():
            dst = self.cache.slots[bank]
            for e, s in zip(experts.tolist(), slots.tolist()):
                self.banks.h2d(expert_part(dst, s, src[e]), src[e], self.cuda)

    def warm(self, seed: int = 0, preferred: dict[int, list[int]] | None = None) -> None:
        """Fills every free slot: with `preferred` experts first (what the cache held when
        this model last served), then spread evenly over the cached layers."""
        rng = np.random.default_rng(seed)
        layers = [layer for layer in self.banks.layers if layer not in self.cpu_layers]
        if preferred:
            self._restore(preferred, layers)
        free = int((self.cache.owner < 0).sum())
        per = min(self.banks.num_experts, free // max(1, len(layers)))
        for layer in layers:
            have = self.cache.slot_of[layer] >= 0
            candidates = rng.permutation(np.flatnonzero(~have))[: max(0, per - int(have.sum()))]
            if len(candidates):
                slots = self.cache.allocate(layer, candidates, np.empty(0, dtype=np.int64))
                self.copy_in(layer, candidates, slots)

    def _restore(self, preferred: dict[int, list[int]], layers: list[int]) -> None:
        """As many of each layer's `preferred` experts (the first first) as the free slots
        hold, the same fraction of every layer where they do not all fit."""
        E, have = self.banks.num_experts, self.cache.slot_of
        wanted = {
            layer: [
                e
                for e in dict.fromkeys(preferred.get(layer, ()))
                if 0 <= e < E and have[layer][e] < 0
            ]
            for layer in layers
        }
        total, free = sum(map(len, wanted.values())), int((self.cache.owner < 0).sum())
        if not total or not free:
            return
        scale = min(1.0, free / total)
        for layer, experts in wanted.items():
            take = np.asarray(experts[: int(len(experts) * scale)], dtype=np.int64)
            if len(take):
                slots = self.cache.allocate(layer, take, np.empty(0, dtype=np.int64))
                self.copy_in(layer, take, slots)
