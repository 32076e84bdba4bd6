"""The offload backend of the experts op: GPU cache hits, PCIe fetches and CPU execution.

Per MoE layer and step, over the union of the batch's experts:
  hits    run on the GPU from their slots;
  misses  are split: q are fetched over PCIe into slots and run on the GPU, the other m−q
          run in place on the CPU from the host banks, at the same time.
The two partial outputs are added; every route is computed exactly once.

Policies (moe/policy.py): resident, lru-pcie (q = m), cpu-misses (q = 0), static-layers
(whole layers on the CPU, the rest fixed on the GPU, like --n-cpu-moe), adaptive (q and the
placement chosen by measured step times, moe/tuning.py). On a machine without a GPU every
expert runs on the CPU through the same code. With device-kept books, decode steps (a batch
too) of lru-pcie (and of adaptive, when it measures that faster) keep the cache's books on
the device and fetch misses with a GPU kernel (`device_lru.DeviceLRU`): no host work inside
the step. This class holds the state and routes each call to its execution path
(moe/paths.py); placement lives in moe/placement.py.
"""

from __future__ import annotations

import logging
import time

import torch

from freetoken import config
from freetoken.kernels import cpu as cpu_kernel
from freetoken.moe import hotset
from freetoken.moe import lane as lanes
from freetoken.moe.backend import ExpertBackend
from freetoken.moe.banks import HostBanks
from freetoken.moe.cache import ExpertCache
from freetoken.moe.counters import Counters
from freetoken.moe.device_lru import DeviceLRU
from freetoken.moe.dispatch import Split
from freetoken.moe.learned import Learned
from freetoken.moe.lookahead import Lookahead
from freetoken.moe.paths import CpuPath, DeviceBooksPath, HostBooksPath, Shared
from freetoken.moe.placement import PlacementState
from freetoken.moe.policy import POLICIES, Mode, Policy, measured_modes
from freetoken.moe.prefill import LayerStreamer
from freetoken.moe.staging import Staging
from freetoken.moe.tuning import (
    DECODE_TOKENS,
    PREFILL_TOKENS,
    AdaptiveTuner,
)

__all__ = ["POLICIES", "OffloadExperts"]

log = logging.getLogger(__name__)


class OffloadExperts(ExpertBackend):
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
        learned: Learned | None = None,
        hot: hotset.HotSet | None = None,
        lookahead: bool = False,
    ):
        self.policy = Policy.parse(policy)
        self.learned, self.hot = learned, hot
        self._served, self._saved_at = False, time.monotonic()  # since the hot set's last save
        self.banks, self.cache, self.split, self.device = banks, cache, split, device
        self.cuda = device.type == "cuda"
        self.placement = PlacementState(banks, cache, device)
        if cache is not None:
            self.placement.place(self.policy)
        adaptive = self.policy is Policy.ADAPTIVE
        # the CPU routes of single-token steps (adaptive's, cpu-misses', a model without a
        # cache), served without cutting the step's graph
        lane_wanted = adaptive or cache is None or self.policy is Policy.CPU_MISSES
        self.lane = lanes.make(banks, device) if cpu_lane and lane_wanted else None
        self._wait = torch.cuda.Event(blocking=True) if self.cuda and self.lane else None
        self.shared = Shared(
            banks,
            cache,
            device,
            split,
            self.placement,
            Counters(),
            self.lane,
            Staging(device) if self.cuda else None,
            torch.cuda.Stream(device) if self.cuda else None,
        )
        self.cpu = CpuPath(self.shared)
        self.host_books = HostBooksPath(self.shared, self.cpu, self._choose, self.policy.uses_cpu)
        self.device_books = DeviceBooksPath(self.shared, self.cpu)
        self._lookahead = lookahead  # wanted: built once the model's routers are given
        # cpu-misses keeps the books on the device where the lane computes its misses: split
        # at a share of 0, each step one graph (the host's books cost a round trip a layer)
        self._device_lru = device_lru and (
            self.policy.device_books or (self.policy is Policy.CPU_MISSES and self.lane is not None)
        )
        # adaptive's tuner starts from what it learned here before, else the bandwidths'
        # share; it measures parts of the lane's team where the lane has workers
        spare = self.lane is not None and len(self.lane.cpus) > 1
        teams = config.current().lane_teams if spare else (1.0,)
        known, costs = self._known(), self._costs()
        self.tuner = AdaptiveTuner.starting(known, costs, teams) if adaptive else None
        self.lru = self._new_lru()
        # prefill streams whole layers through two buffers, when the pool has room for them
        self._prefill_overlap = prefill_overlap
        self.streamer: LayerStreamer | None = None
        self._make_streamer()

    # --- what a placement needs ---------------------------------------------------------------
    def _new_lru(self) -> DeviceLRU | None:
        lru = None
        if self._device_lru and self.cache is not None:
            lru = DeviceLRU(self.cache, self.banks, self.device)
            lru.share.fill_(self.tuner.share if self.tuner else self._fixed_share())
        if self.tuner is not None:
            self._choose_placements(lru)
        elif self.policy is Policy.CPU_MISSES:
            self.placement.mode = Mode.SPLIT if lru is not None else Mode.CACHE
        return lru

    def _fixed_share(self) -> float:
        """The share of misses a fixed policy's device-kept books fetch."""
        return 0.0 if self.policy is Policy.CPU_MISSES else 1.0

    def _known(self) -> dict | None:
        """What adaptive learned before for this cache size on this machine."""
        if self.learned is None or self.cache is None:
            return None
        return self.learned.load(self.cache.capacity)

    def _choose_placements(self, lru: DeviceLRU | None) -> None:
        """Adaptive's chooser: it serves from the placement learned here before, else the
        one the bandwidths predict, and saves what it measures for the next load."""
        E, L = self.banks.num_experts, len(self.banks.layers)
        shape = (L, E, self.cache.capacity if self.cache is not None else 0)
        books, lane = lru is not None, self.lane is not None
        modes = measured_modes(*shape, books, lane) if self.cache is not None else None
        known = self._known()
        if modes is None and lru is not None:
            # every expert cached: nothing to choose, and every route hits, so the books stay
            # on the device and a step is one graph (the host-kept books would cost a round
            # trip a layer for no miss)
            self.placement.mode = Mode.DEVICE
        self.tuner.choose(modes, known, shape, self._costs(), self._lookups, lru is not None)
        if self.learned is not None and self.cache is not None:
            capacity, store = self.cache.capacity, self.learned
            self.tuner.on_measured = lambda data: store.save(capacity, data)

    def _costs(self) -> tuple[float, float]:
        """One expert's seconds over PCIe (the fetch kernel's where measured: adaptive's
        placements keep the books on the device) and on the CPU."""
        return self.split.fetch_s or self.split.pcie.per_expert, self.split.cpu.per_expert

    def _make_streamer(self) -> None:
        self.streamer = None
        if self.policy.streams_prefill and LayerStreamer.possible(
            self.cache, self.banks.num_experts
        ):
            self.streamer = LayerStreamer(
                self.banks,
                self.cache,
                self.banks.layers,
                self.device,
                self.shared.copy_stream,
                self._prefill_overlap,
            )

    # --- the cache's books ----------------------------------------------------------------
    def _on_device_path(self, tokens: int) -> bool:
        """Whether a step of `tokens` tokens keeps the cache's books on the device. A batch
        of decode steps does where every miss is fetched, or a share goes to the CPU lane
        (its graph then stays whole, where the host's books cost a round trip a layer), and
        the pool holds a layer's every expert, so no step's experts evict each other."""
        if self.lru is None or self.cache.fixed.any():
            return False
        if tokens == 1:
            return self.policy is Policy.LRU_PCIE or self.placement.mode.books_on_device
        mode = self.placement.mode
        lane = self.lane is not None and self.lane.serves(tokens)
        return (
            tokens <= DECODE_TOKENS
            and self.cache.capacity >= self.banks.num_experts
            and (
                self.policy is Policy.LRU_PCIE
                or mode is Mode.DEVICE
                or (mode is Mode.SPLIT and lane)
            )
        )

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
            steps = self.shared.counters.steps
            steps["m"] += misses
            steps["q"] += fetched

    def _lookups(self) -> tuple[int, int]:
        """The cache's hits and misses so far, the device-kept books' included."""
        st = self.cache.stats(self._unpulled())
        return st["hits"], st["misses"]

    def _unpulled(self) -> tuple[int, int, int, int]:
        """Hits, misses, evictions and fetches the device-kept books counted that the host
        has not."""
        lru = self.lru  # statistics run on other threads: one look at it
        if lru is None or not lru.live:
            return 0, 0, 0, 0
        return tuple(lru.unpulled().sum(axis=0).tolist())

    def keep_books_on_host(self) -> bool:
        if self.lru is None:
            return False
        self._take_books()
        self._device_lru = False
        self.lru = self._new_lru()
        if self.placement.mode is Mode.DEVICE:
            self.placement.mode = Mode.CACHE
        return True

    # --- the op ---------------------------------------------------------------------------
    def __call__(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        p = self.placement
        if self.lru is not None:
            self._books(ids.shape[0])
            if self.lru.live:
                split = p.mode is Mode.SPLIT
                return self.device_books(layer, x, ids, weights, self.lru, split)
        if p.is_cpu(layer):
            return self.cpu.layer(layer, x, ids, weights)
        if self.streamer is not None and ids.shape[0] > PREFILL_TOKENS:
            return self.streamer(layer, x, ids, weights)
        if layer in p.fixed_layers:
            self.account_device(layer, ids.numel())
            return self.shared.from_slots(layer, x, p.fixed_slots[layer][ids], weights)
        return self.host_books(layer, x, ids, weights)

    def _choose(self, m: int, T: int) -> int:
        """How many of a cached layer's m misses to fetch in a step of T tokens."""
        if m == 0:
            return 0
        if self.policy.fetches_every_miss or T > PREFILL_TOKENS:
            return m
        if self.policy is Policy.CPU_MISSES:
            return 0
        if self.placement.mode is Mode.DEVICE:  # a batch of streams in device: every miss too
            return m
        if T <= DECODE_TOKENS:
            return round(self.tuner.share * m)
        return self.split.choose(m)

    def device_only(self, layer: int, tokens: int = 1) -> bool:
        p = self.placement
        if p.is_cpu(layer):
            return self.lane is not None and self.lane.serves(tokens)
        return layer in p.fixed_layers or (
            self._on_device_path(tokens) and (p.mode is not Mode.SPLIT or self.lane is not None)
        )

    def account_device(self, layer: int, routes: int) -> None:
        self.shared.account_device(layer, routes)

    def use_routers(self, routers: dict) -> None:
        """Guesses come only where every miss is fetched with the books on the device: a
        decode step of lru-pcie, or of adaptive's device placement."""
        if self._lookahead and self._device_lru and self.cache is not None:
            self.device_books.lookahead = Lookahead(
                routers, list(self.banks.layers), self.device, self.placement.is_cpu
            )

    # --- between steps --------------------------------------------------------------------
    def between_steps(self, tokens: int) -> None:
        """Times the step that just ended (adaptive), moves to the placement the tuner asks
        for, and hands the cache's books to the side that keeps them for this step."""
        p = self.placement
        self._served = True
        if self.tuner is not None and self.tuner.step_started(tokens, p.mode):
            if self.lru is not None:  # read by the books on the device, also in captured steps
                self.lru.share.fill_(self.tuner.share)
        if self.tuner is not None and self.tuner.locality is not None and tokens <= DECODE_TOKENS:
            self.tuner.judge_locality(self._lookups)
        if self.lane is not None:
            self.lane.start()
        if self.tuner is not None:
            want = self.tuner.wanted(tokens, p.mode)
            if want != p.mode:
                self._switch(want)
            if self.lane is not None:
                self.lane.size_team(self.tuner.team(p.mode))
        self._books(tokens)

    def _switch(self, want: Mode) -> None:
        p = self.placement
        self._take_books()
        if self.cuda:
            torch.cuda.synchronize(self.device)  # nothing may still read the slots being refilled
        old = p.mode
        if want is Mode.LAYERS:
            self.streamer = None  # its buffers would overwrite fixed experts
            p.enter_layers()
        elif old is Mode.LAYERS:
            p.leave_layers()
            self._make_streamer()
        p.mode = want
        self.tuner.moved(old, want)

    @property
    def generation(self) -> tuple[int, int, bool]:
        cache_version = self.cache.version if self.cache is not None else 0
        return (self.placement.version, cache_version, self.lru is not None)

    @property
    def variant(self) -> Mode:
        # each placement cuts and launches its steps its own way over the same slots
        return self.placement.mode

    def wait_step(self) -> None:
        # Where a CPU lane computes during steps, a host thread spinning on the GPU would take
        # a core from the lane's pinned workers; waking costs microseconds against a step's
        # milliseconds.
        if self._wait is not None:
            self._wait.record()
            self._wait.synchronize()
        elif self.cuda:
            torch.cuda.current_stream(self.device).synchronize()

    @property
    def waits_asleep(self) -> bool:
        return self._wait is not None

    # --- the cache ------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.cache.capacity if self.cache is not None else 0

    @property
    def expert_bytes(self) -> int:
        return self.banks.slot_bytes

    @property
    def host_bytes(self) -> int:
        return self.banks.total_bytes

    @property
    def floor(self) -> int:
        """The fewest slots a resize may leave: one layer's experts (a prefill chunk's need)."""
        return self.banks.num_experts

    def warm(self, seed: int = 0) -> None:
        if self.lane is not None:
            self.lane.warm(self.banks.dtype)
        if self.cache is None:
            return
        self._take_books()
        self.placement.warm(seed, self.hot.load() if self.hot is not None else None)
        self._enter_start()
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def _enter_start(self) -> None:
        """Moves now to the placement adaptive's first decode step asks for. Left to that
        step, the move dropped every decode graph the load had captured (in the cache's
        placement) and the first answer captured them again, with whatever the device books'
        placement compiles: on a fresh H200 that capture came 0.94 s after the move."""
        if self.tuner is not None and self.tuner.modes is not None:
            want = self.tuner.wanted(1, self.placement.mode)
            if want != self.placement.mode:
                self._switch(want)

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
        if self.policy is Policy.RESIDENT and slots < L * E:
            raise ValueError(f"the resident policy needs all {L * E} expert slots")
        self._take_books()
        if self.cuda:
            torch.cuda.synchronize(self.device)  # nothing may still read the old pool
        # fixed placements are recomputed for the new size; adaptive's whole-layer placement,
        # if any, is measured again
        self.placement.release_layers()
        if self.policy.fixed:
            kept = self.cache.resize(slots, keep_warm=False)
            self.placement.place(self.policy)
        else:
            self.placement.mode = Mode.CACHE
            kept = self.cache.resize(slots)
            self.placement.place(self.policy)  # every expert fixed where the pool holds all
            self.lru = self._new_lru()
        self._make_streamer()
        log.info(
            "expert cache resized to %d slots (%.2f GiB), %d experts kept",
            slots,
            slots * self.cache.expert_bytes / 2**30,
            kept,
        )
        return {"slots": slots, "kept": kept, "bytes": slots * self.cache.expert_bytes}

    # --- statistics -----------------------------------------------------------------------
    @property
    def steps(self) -> dict:
        """Counters of routed work (a copy), with the misses the device-kept books have counted
        and the experts fetched on guesses ("guessed", apart from q: fetches of missed routes)."""
        _, m, _, f = self._unpulled()
        s = self.shared.counters.steps
        ahead = self.device_books.lookahead
        return {
            **s,
            "m": s["m"] + m,
            "q": s["q"] + f,
            "guessed": ahead.fetched() if ahead is not None else 0,
        }

    @property
    def timers(self) -> dict:
        return dict(self.shared.counters.timers)

    def counters(self) -> dict:
        return {**self.steps, **self.timers}

    def stats(self) -> dict:
        lru = self.lru  # one look: another thread may drop it
        split = self.split
        out = {
            "policy": str(self.policy),
            **self.counters(),
            "books": "device" if lru is not None and lru.live else "host",
            "pcie_cost_ms": split.pcie.per_expert * 1e3,
            "pcie_fixed_ms": split.pcie.fixed * 1e3,
            "cpu_cost_ms": split.cpu.per_expert * 1e3,
            "cpu_fixed_ms": split.cpu.fixed * 1e3,
            "fetch_cost_ms": split.fetch_s * 1e3 or None,
            "b_p_gbps": split.b_p / 1e9,
            "b_h_gbps": split.b_h / 1e9,
            "expert_bytes": self.banks.expert_bytes,
            "cpu_kernel": cpu_kernel.tier(),
            "cpu_layers": sorted(self.placement.cpu_layers),
        }
        if self.lane is not None:
            out["lane"] = self.lane.stats()
        if self.tuner is not None:
            out |= self.tuner.stats()
        if self.cache is not None:  # while the device keeps the books, it says which slots are used
            used = lru.used() if lru is not None and lru.live else None
            out["cache"] = self.cache.stats(self._unpulled(), used)
        if self.streamer is not None:
            out["prefill_streaming"] = dict(self.streamer.stats)
        return out

    def idle(self) -> None:
        """Keeps what the cache holds for the next load of this model, once serving pauses
        (at most every `SAVE_EVERY_S`): an unload comes as the runner's end, with no word."""
        if self.hot is None or self.cache is None or not self._served:
            return
        now = time.monotonic()
        if now - self._saved_at >= hotset.SAVE_EVERY_S:
            self._served, self._saved_at = False, now
            self._take_books()
            self.hot.save(hotset.resident(self.cache, list(self.banks.layers)))

    def close(self) -> None:
        """Frees the pinned staging buffers and stops the lane's thread (both come back on
        the next use)."""
        if self.shared.stage is not None:
            self.shared.stage.clear()
        if self.lane is not None:
            self.lane.stop()
