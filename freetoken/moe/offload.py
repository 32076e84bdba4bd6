"""The offload backend of the experts op: GPU cache hits, PCIe fetches and CPU execution.

Per MoE layer and step, over the union of the batch's experts:
  hits    run on the GPU from their slots;
  misses  are split: q are fetched over PCIe into slots and run on the GPU, the other m−q
          run in place on the CPU from the host banks, at the same time.
The two partial outputs are added; every route is computed exactly once.

Policies: resident (every expert in a slot), lru-pcie (q = m), cpu-misses (q = 0),
static-layers (whole layers on the CPU, the rest fixed on the GPU, like --n-cpu-moe),
adaptive (q from costs fitted online). On a machine without a GPU every expert runs on the
CPU through the same code. With `device_lru`, single-token decode steps of lru-pcie (and of
adaptive, when it measures that faster) keep the cache's books on the device and fetch
misses with a GPU kernel (`device_lru.DeviceLRU`): no host work inside the step.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from freetoken.kernels import cpu as cpu_kernel
from freetoken.kernels import moe_gpu
from freetoken.moe import lane
from freetoken.moe.banks import HostBanks
from freetoken.moe.cache import ExpertCache
from freetoken.moe.device_lru import DeviceLRU
from freetoken.moe.dispatch import ModeChooser, ShareTuner, Split
from freetoken.moe.prefill import LayerStreamer
from freetoken.moe.staging import CopyTimings, Staging

log = logging.getLogger(__name__)

POLICIES = ("adaptive", "resident", "lru-pcie", "cpu-misses", "static-layers")
PREFILL_TOKENS = 32  # above this the CPU would be compute-bound: misses are fetched
DECODE_TOKENS = 8  # steps this small tune the PCIe/CPU share


class OffloadExperts:
    def __init__(
        self,
        banks: HostBanks,
        cache: ExpertCache | None,
        policy: str,
        split: Split,
        device: torch.device,
        prefill_overlap: bool = True,
        device_lru: bool = False,
        cpu_lane: bool = False,
    ):
        if policy not in POLICIES:
            raise ValueError(f"unknown MoE policy {policy!r} (choose from {', '.join(POLICIES)})")
        self.banks, self.cache, self.policy, self.split, self.device = (
            banks,
            cache,
            policy,
            split,
            device,
        )
        self.cuda = device.type == "cuda"
        self.cpu_layers: set[int] = set(banks.layers) if cache is None else set()
        self._fixed_layers: set[int] = set()
        self._copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self._stage = Staging(device) if self.cuda else None
        # the bandwidth split's share of misses over PCIe is where the tuner starts
        self.tuner = ShareTuner(
            split.cpu.per_expert / (split.cpu.per_expert + split.pcie.per_expert)
        )
        self._tick: float | None = None  # when the last decode step started
        self._told_steps = (
            False  # whether the engine calls between_steps (else layer 0 marks a step)
        )
        self._typical = 0.0  # a running step time, to drop intervals that span idle time
        self._fetch_times = CopyTimings()
        self._steps = {"q": 0, "m": 0, "cpu_routes": 0, "layers": 0}
        self.generation = 0  # bumped whenever slot tensors move: captured graphs must be redone
        # where the host's time goes: waiting for the GPU, waiting for the CPU part, in total
        self.timers = {"sync_s": 0.0, "cpu_wait_s": 0.0, "host_s": 0.0}
        if cache is not None:
            self._place()
        self._device_lru = device_lru and policy in ("lru-pcie", "adaptive")
        self.lru = self._new_lru()
        # adaptive's CPU routes of single-token steps, served without cutting the step's graph
        self.lane = (
            lane.make(banks, device)
            if cpu_lane and (policy == "adaptive" or cache is None)
            else None
        )
        # adaptive also chooses between the cache (its books on the host or on the device) and
        # whole layers on the CPU, by measurement
        self.mode = "cache"
        self.modes = self._mode_chooser()
        # prefill streams whole layers through two buffers, when the pool has room for them
        self._prefill_overlap = prefill_overlap
        self.streamer = None
        self._make_streamer()

    def _new_lru(self) -> DeviceLRU | None:
        if not self._device_lru or self.cache is None:
            return None
        lru = DeviceLRU(self.cache, self.banks, self.device)
        lru.share.fill_(self.tuner.share)
        return lru

    def _mode_chooser(self) -> ModeChooser | None:
        E, L = self.banks.num_experts, len(self.banks.layers)
        if self.policy != "adaptive" or self.cache is None or self.cache.capacity >= L * E:
            return None
        modes = (
            ("device", "split", "cache", "layers") if self.lru is not None else ("cache", "layers")
        )
        return ModeChooser(modes=modes, rounds=2)

    @property
    def steps(self) -> dict:
        """Counters of routed work (a copy), with the misses the device-kept books have counted."""
        _, m, _, f = self._unpulled()
        return {**self._steps, "m": self._steps["m"] + m, "q": self._steps["q"] + f}

    def _unpulled(self) -> tuple[int, int, int, int]:
        """Hits, misses, evictions and fetches the device-kept books counted that the host has not."""
        lru = self.lru  # statistics run on other threads: one look at it
        if lru is None or not lru.live:
            return 0, 0, 0, 0
        return tuple(lru.unpulled().sum(axis=0).tolist())

    def _on_device_path(self, tokens: int) -> bool:
        """Whether a step of `tokens` tokens keeps the cache's books on the device."""
        if self.lru is None or tokens != 1 or self.cache.fixed.any():
            return False
        return self.policy == "lru-pcie" or self.mode in ("device", "split")

    def _books(self, tokens: int) -> None:
        """Hands the cache's books to whichever side the next step of `tokens` keeps them on."""
        if self.lru is None:
            return
        if self._on_device_path(tokens):
            if not self.lru.live:
                self.lru.push()
        else:
            self._take_books()

    def _take_books(self) -> None:
        """The host keeps the cache's books from now on."""
        if self.lru is not None and self.lru.live:
            misses, fetched = self.lru.pull()
            self._steps["m"] += misses
            self._steps["q"] += fetched

    def keep_books_on_host(self) -> bool:
        """Stops keeping the cache's books on the device, for good; True if it did."""
        if self.lru is None:
            return False
        self._take_books()
        self.lru, self._device_lru = None, False
        self.modes = self._mode_chooser()
        self.mode = "cache" if self.mode == "device" else self.mode
        self.generation += 1
        return True

    def _make_streamer(self) -> None:
        self.streamer = None
        if self.policy in ("adaptive", "lru-pcie", "cpu-misses") and LayerStreamer.possible(
            self.cache, self.banks.num_experts
        ):
            self.streamer = LayerStreamer(
                self.banks,
                self.cache,
                self.banks.layers,
                self.device,
                self._copy_stream,
                self._prefill_overlap,
            )

    # --- placement -------------------------------------------------------------------
    def _place(self) -> None:
        L, E = len(self.banks.layers), self.banks.num_experts
        if self.policy == "resident":
            if self.cache.capacity < L * E:
                raise ValueError(
                    f"the resident policy needs {L * E} expert slots "
                    f"({L * E * self.cache.expert_bytes / 2**30:.1f} GiB); the budget gives "
                    f"{self.cache.capacity}"
                )
            self._fix_layers(self.banks.layers)
        elif self.policy == "static-layers":
            self._place_layers()

    def _place_layers(self) -> None:
        """The first layers on the CPU, as many of the last as fit fixed in slots."""
        L, E = len(self.banks.layers), self.banks.num_experts
        fit = min(L, self.cache.capacity // E)
        self.cpu_layers = set(self.banks.layers[: L - fit])
        self._fix_layers(self.banks.layers[L - fit :])

    def _fix_layers(self, gpu_layers: list[int]) -> None:
        E = self.banks.num_experts
        for layer in gpu_layers:
            experts = np.arange(E)
            self._copy_in(layer, experts, self.cache.fix(layer, experts))
        # layers whose experts are all fixed in slots route on the device: no host round trip
        self._fixed_layers = set(gpu_layers)
        self.generation += 1
        self._fixed_slots = torch.from_numpy(self.cache.slot_of.copy()).to(self.device)

    def _copy_in(self, layer: int, experts: np.ndarray, slots: np.ndarray) -> None:
        gu, dn = self.banks.banks[layer]
        for bank, src in (("gate_up", gu), ("down", dn)):
            dst = self.cache.slots[bank]
            for e, s in zip(experts.tolist(), slots.tolist()):
                dst[s].copy_(src[e], non_blocking=self.cuda)

    def warm(self, seed: int = 0) -> None:
        """Fills every free slot, spread evenly over the layers (benchmarks start from a full cache)."""
        if self.cache is None:
            return
        self._take_books()
        rng = np.random.default_rng(seed)
        layers = [l for l in self.banks.layers if l not in self.cpu_layers]
        free = int((self.cache.owner < 0).sum())
        per = min(self.banks.num_experts, free // max(1, len(layers)))
        for layer in layers:
            have = self.cache.slot_of[layer] >= 0
            candidates = rng.permutation(np.flatnonzero(~have))[: max(0, per - int(have.sum()))]
            if len(candidates):
                slots = self.cache.allocate(layer, candidates, np.empty(0, dtype=np.int64))
                self._copy_in(layer, candidates, slots)
        if self.cuda:
            torch.cuda.synchronize(self.device)

    # --- the op ----------------------------------------------------------------------
    def __call__(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        if self.policy == "adaptive" and layer == self.banks.layers[0] and not self._told_steps:
            self._step_started(ids.shape[0])
        if self.lru is not None:
            self._books(ids.shape[0])
            if self.lru.live:
                return self._with_device_books(layer, x, ids, weights)
        if self.cache is None or layer in self.cpu_layers:
            return self._cpu_layer(layer, x, ids, weights)
        if self.streamer is not None and ids.shape[0] > PREFILL_TOKENS:
            return self.streamer(layer, x, ids, weights)
        if layer in self._fixed_layers:
            self.account_device(layer, ids.numel())
            return self._from_slots(x, self._fixed_slots[layer][ids], weights)
        return self._with_host_books(layer, x, ids, weights)

    def _cpu_layer(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """A layer whose experts all run on the CPU: through the lane inside a single-token step."""
        if self.lane is not None and ids.shape[0] == 1:
            self.account_device(layer, ids.numel())
            self.lane.start()
            self.lane.post(layer, x, ids, weights)
            return self.lane.collect(torch.zeros_like(x))
        return self._all_on_cpu(layer, x, ids, weights)

    def _with_host_books(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """The host looks up the layer's experts, fetches q of the misses and computes the rest."""
        t_enter = time.perf_counter()
        x_h, w_h = None, None
        if self._stage is None:
            ids_h = ids.cpu().numpy()
        elif self.policy in ("adaptive", "cpu-misses"):  # the CPU may need the activations too
            ids_t, x_h, w_h = self._stage.pull(
                ids, x, weights
            )  # the one host round trip of the layer
            ids_h = ids_t.numpy()
        else:
            ids_h = self._stage.pull(ids)[0].numpy()
        self.timers["sync_s"] += time.perf_counter() - t_enter
        T = ids_h.shape[0]
        experts, counts = np.unique(ids_h, return_counts=True)
        slots = self.cache.lookup(layer, experts)
        miss = slots < 0
        m = int(miss.sum())
        # never fetch more than the pool can hold next to this step's hits and fixed experts
        room = self.cache.capacity - int((~miss).sum()) - int(self.cache.fixed.sum())
        q = min(self._choose(m, T), max(room, 0))
        order = np.flatnonzero(miss)[np.argsort(-counts[miss], kind="stable")]  # most-shared first
        fetch, on_cpu = order[:q], order[q:]
        if q:
            slots[fetch] = self.cache.allocate(layer, experts[fetch], slots[~miss])
            self._fetch(layer, experts[fetch], slots[fetch], q)
        slot_map = np.full(self.banks.num_experts, -1, dtype=np.int32)
        slot_map[experts] = slots  # CPU experts keep -1
        route_slots = torch.from_numpy(slot_map[ids_h]).to(self.device, non_blocking=self.cuda)
        if self._copy_stream is not None and q:
            torch.cuda.current_stream(self.device).wait_stream(self._copy_stream)
        out = self._from_slots(x, route_slots, weights)
        self.cache.touch(slots)
        self._account(m, q, len(on_cpu), T)
        if len(on_cpu):
            # The GPU part is queued and runs meanwhile. The CPU part runs on this thread, which
            # joins the kernel's thread team: a worker thread would leave the host thread fighting
            # the kernel's pinned threads for a core, and cost a hand-off per layer.
            t_wait = time.perf_counter()
            partial = self._on_cpu(
                layer,
                x if x_h is None else x_h,
                ids_h,
                weights if w_h is None else w_h,
                experts[on_cpu],
            )
            self.timers["cpu_wait_s"] += time.perf_counter() - t_wait
            out = out + partial.to(device=self.device, dtype=out.dtype, non_blocking=self.cuda)
        self.timers["host_s"] += time.perf_counter() - t_enter
        return out

    def _with_device_books(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        self.account_device(layer, ids.numel())
        if self.mode == "split":
            return self._split(layer, x, ids, weights)
        return self._from_slots(x, self.lru(layer, ids), weights)

    def _from_slots(
        self, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        return moe_gpu.experts_from_slots(
            x, slots, weights, self.cache.slots["gate_up"], self.cache.slots["down"]
        )

    def _split(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """One token's layer with the books on the device: a share of the misses fetched by
        the GPU while the CPU computes the others. Through the CPU lane nothing here waits (the
        step stays one graph); otherwise the host waits for the books' answer (which routes
        are the CPU's), not for the fetch."""
        t_enter = time.perf_counter()
        slots, fetch, cpu = self.lru.assign(layer, ids, split=True)
        if self.lane is not None:
            self.lane.start()
            self.lane.post(layer, x, ids, weights, cpu)  # the CPU starts on its routes now
            self.lru.fetch(layer, ids, fetch)
            return self.lane.collect(self._from_slots(x, slots, weights))
        staged = self._stage.pull_async(ids, cpu, x, weights) if self._stage is not None else None
        self.lru.fetch(layer, ids, fetch)  # queued after the copies the host waits for
        out = self._from_slots(x, slots, weights)
        if staged is not None:
            self._stage.wait()
            ids_t, cpu_t, x, weights = staged
        else:
            ids_t, cpu_t = ids.cpu(), cpu.cpu()
        self.timers["sync_s"] += time.perf_counter() - t_enter
        ids_h, cpu_h = ids_t.numpy(), cpu_t.numpy()
        if cpu_h.any():
            t_wait = time.perf_counter()
            partial = self._on_cpu(layer, x, ids_h, weights, ids_h.reshape(-1)[cpu_h])
            self.timers["cpu_wait_s"] += time.perf_counter() - t_wait
            out = out + partial.to(device=self.device, dtype=out.dtype, non_blocking=self.cuda)
        self._steps["cpu_routes"] += int(cpu_h.sum())
        self.timers["host_s"] += time.perf_counter() - t_enter
        return out

    # --- what adaptive learns, between decode steps ----------------------------------------
    def _step_started(self, T: int) -> None:
        """Times the decode step that just ended (first layer to first layer) and feeds the
        share tuner and the mode chooser; steps of a prefill, or spanning idle time, are not counted."""
        now = time.perf_counter()
        last, self._tick = self._tick, (now if T <= DECODE_TOKENS else None)
        if last is None or self._tick is None:
            return
        dt = now - last
        if self._typical and dt > 5 * self._typical:
            return
        self._typical = dt if not self._typical else 0.9 * self._typical + 0.1 * dt
        if self.modes is not None:
            self.modes.observe(dt)
        if self.mode in ("cache", "split"):
            self.tuner.observe(dt)
            self.tuner.next_arm()
            if self.lru is not None:  # read by the books on the device, also in captured steps
                self.lru.share.fill_(self.tuner.share)

    def between_steps(self, tokens: int = 1) -> None:
        """Moves to the placement the mode chooser asked for and hands the cache's books to the
        side that keeps them for a step of `tokens` tokens; the engine calls it before every
        step (captured steps run no Python inside the layers). A prefill goes back to the
        cache: whole CPU layers would compute a long prompt's experts on the CPU, where
        streaming them to the GPU is far faster."""
        if self.policy == "adaptive":
            # steps are timed here once a caller says when they start: a step replayed from
            # one CUDA graph runs no Python in its layers
            self._told_steps = True
            self._step_started(tokens)
        if self.lane is not None:
            self.lane.start()
        if self.modes is not None:
            keep = self.mode in ("device", "split")  # the cache's shapes; a prefill runs in either
            want = self.modes.mode if tokens <= PREFILL_TOKENS else (self.mode if keep else "cache")
            if want != self.mode:
                self._switch(want)
        self._books(tokens)

    def _switch(self, want: str) -> None:
        self._take_books()
        if self.cuda:
            torch.cuda.synchronize(self.device)  # nothing may still read the slots being refilled
        if want == "layers":
            self.streamer = None  # its buffers would overwrite fixed experts
            self.cache.clear()
            self._place_layers()
        else:
            if self.mode == "layers":
                self.cache.fixed[:] = False  # the fixed experts stay, as cached ones
                self.cpu_layers, self._fixed_layers = set(), set()
                self._make_streamer()
            self.generation += 1  # captured steps are cut differently in each mode
        log.debug(
            "adaptive placement: %s -> %s (step ms %s)",
            self.mode,
            want,
            self.modes.stats()["step_ms"],
        )
        self.mode = want
        self._tick = None

    def device_only(self, layer: int, tokens: int = 1) -> bool:
        """True where a step of this layer needs no host work (so it can run inside a CUDA graph)."""
        if self.cache is None or layer in self.cpu_layers:
            return self.lane is not None and tokens == 1
        return layer in self._fixed_layers or (
            self._on_device_path(tokens) and (self.mode != "split" or self.lane is not None)
        )

    def account_device(self, layer: int, routes: int) -> None:
        """Counts a layer run on the device, eagerly or replayed (a capture counts nothing)."""
        if lane.capturing(self.device):
            return
        lane_layer = self.cache is None or layer in self.cpu_layers  # a token's top-k, all misses
        self._account(routes if lane_layer else 0, 0, routes if lane_layer else 0, 1)
        if layer in self._fixed_layers:  # the device path counts its hits itself
            self.cache.hits[layer] += routes

    def _choose(self, m: int, T: int) -> int:
        if m == 0:
            return 0
        if self.policy in ("lru-pcie", "resident", "static-layers") or T > PREFILL_TOKENS:
            return m
        if self.policy == "cpu-misses":
            return 0
        if T <= DECODE_TOKENS:
            return round(self.tuner.share * m)
        return self.split.choose(m)

    def _fetch(self, layer: int, experts: np.ndarray, slots: np.ndarray, q: int) -> None:
        if self._copy_stream is None:
            t0 = time.perf_counter()
            self._copy_in(layer, experts, slots)
            self.split.pcie.observe(q, time.perf_counter() - t0)
            return
        # slots being overwritten may still be read by work already queued on the compute stream
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self._copy_stream):
            start.record()
            self._copy_in(layer, experts, slots)
            end.record()
        self._fetch_times.record(q, start, end, self.split.pcie)

    def _on_cpu(
        self,
        layer: int,
        x: torch.Tensor,
        ids_h: np.ndarray,
        weights: torch.Tensor,
        cpu_experts: np.ndarray,
    ) -> torch.Tensor:
        """The routes to `cpu_experts`, computed from the host banks; fp32 [T, H]."""
        sel = np.isin(ids_h, cpu_experts)
        tok, col = np.nonzero(sel)
        x_h = x.float().cpu()  # no copy where x is staged in host memory already
        w_h = weights.cpu().float()[torch.from_numpy(tok), torch.from_numpy(col)]
        gu, dn = self.banks.banks[layer]
        exp = torch.from_numpy(ids_h[tok, col].astype(np.int64))
        # pinned, so the result goes back to the GPU without a staging copy
        out = (
            self._stage.buf("partial", tuple(x_h.shape), torch.float32).zero_()
            if self._stage is not None
            else None
        )
        t0 = time.perf_counter()
        result = cpu_kernel.moe_experts(
            x_h, gu, dn, torch.from_numpy(tok.astype(np.int64)), exp, w_h, out=out
        )
        self.split.cpu.observe(len(cpu_experts), time.perf_counter() - t0)
        return result

    def _all_on_cpu(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        T, k = ids.shape
        gu, dn = self.banks.banks[layer]
        out = cpu_kernel.moe_experts(
            x.float().cpu(),
            gu,
            dn,
            torch.arange(T).repeat_interleave(k),
            ids.reshape(-1).cpu(),
            weights.reshape(-1).float().cpu(),
        )
        self._account(len(torch.unique(ids)), 0, T * k, T)
        return out.to(device=x.device, dtype=x.dtype)

    def _account(self, m: int, q: int, cpu_routes: int, T: int) -> None:
        s = self._steps
        s["m"] += m
        s["q"] += q
        s["cpu_routes"] += cpu_routes
        s["layers"] += 1

    @property
    def floor(self) -> int:
        """The fewest slots a resize may leave: one layer's experts (a prefill chunk's need)."""
        return self.banks.num_experts

    def resize(self, slots: int) -> dict:
        """Grows or shrinks the slot pool; call between steps. Host banks are untouched."""
        if self.cache is None:
            raise ValueError("this model has no GPU expert cache: every expert runs on the CPU")
        L, E = len(self.banks.layers), self.banks.num_experts
        slots = min(int(slots), L * E)
        if slots < self.floor:
            raise ValueError(
                f"{slots} expert slots is below the floor of {self.floor} (one layer's experts)"
            )
        if self.policy == "resident" and slots < L * E:
            raise ValueError(f"the resident policy needs all {L * E} expert slots")
        self._take_books()
        if self.cuda:
            torch.cuda.synchronize(self.device)  # nothing may still read the old pool
        if self.policy in ("resident", "static-layers"):
            self.cache.fixed[:] = False  # placement is recomputed for the new size
            kept = self.cache.resize(slots, keep_warm=False)
            self._place()
        else:
            self.cache.fixed[:] = (
                False  # adaptive's whole-layer placement, if any, is measured again
            )
            self.cpu_layers, self._fixed_layers, self.mode = set(), set(), "cache"
            kept = self.cache.resize(slots)
            self.lru = self._new_lru()
            self.modes = self._mode_chooser()
        self.generation += 1
        self._make_streamer()
        log.info(
            "expert cache resized to %d slots (%.2f GiB), %d experts kept",
            slots,
            slots * self.cache.expert_bytes / 2**30,
            kept,
        )
        return {"slots": slots, "kept": kept, "bytes": slots * self.cache.expert_bytes}

    def close(self) -> None:
        """Frees the pinned staging buffers (they come back on the next use)."""
        if self._stage is not None:
            self._stage.clear()

    def stats(self) -> dict:
        lru = self.lru  # one look: another thread may drop it
        out = {
            "policy": self.policy,
            **self.steps,
            **self.timers,
            "books": "device" if lru is not None and lru.live else "host",
            "pcie_cost_ms": self.split.pcie.per_expert * 1e3,
            "pcie_fixed_ms": self.split.pcie.fixed * 1e3,
            "cpu_cost_ms": self.split.cpu.per_expert * 1e3,
            "cpu_fixed_ms": self.split.cpu.fixed * 1e3,
            "cpu_kernel": cpu_kernel.tier(),
            "cpu_layers": sorted(self.cpu_layers),
        }
        if self.lane is not None:
            out["lane"] = self.lane.stats()
        if self.policy == "adaptive":
            out["pcie_share"] = self.tuner.stats()
            if self.modes is not None:
                out["placement"] = self.modes.stats()
        if self.cache is not None:  # while the device keeps the books, it says which slots are used
            used = lru.used() if lru is not None and lru.live else None
            out["cache"] = self.cache.stats(self._unpulled(), used)
        if self.streamer is not None:
            out["prefill_streaming"] = dict(self.streamer.stats)
        return out
