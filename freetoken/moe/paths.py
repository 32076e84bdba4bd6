"""The execution paths of the offload backend: one small class per way a layer's experts run.

  CpuPath          every route of a layer on the CPU (through the lane inside a captured
                   single-token step), and the CPU's share of a cached layer's misses;
  HostBooksPath    the host looks up the layer's experts in the cache, fetches q of the m
                   misses over PCIe and computes the others on the CPU, at the same time;
  DeviceBooksPath  decode steps whose cache books live on the device: every miss fetched
                   by a GPU kernel (the next layer's guessed experts fetched ahead, where
                   the model's routers are known), or (single tokens) a tuned share with the
                   CPU taking the rest (each of its misses split by rows with the GPU, where
                   FREETOKEN_SPLIT_ROWS asks: `first_cpu_row`).
Fixed layers (every expert in a slot) and prefill streaming (moe/prefill.py) need no class.
All of them share one `Shared`: the banks, the cache, the counters and the copy machinery.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from freetoken import config
from freetoken.kernels import cpu as cpu_kernel
from freetoken.kernels import moe_gpu
from freetoken.moe import lane as lanes
from freetoken.moe.banks import HostBanks
from freetoken.moe.cache import ExpertCache
from freetoken.moe.counters import Counters
from freetoken.moe.device_lru import DeviceLRU
from freetoken.moe.dispatch import Split
from freetoken.moe.lookahead import Lookahead
from freetoken.moe.placement import PlacementState
from freetoken.moe.staging import CopyTimings, Staging


@dataclass(eq=False)
class Shared:
    """What every path of one backend reads and updates."""

    banks: HostBanks
    cache: ExpertCache | None
    device: torch.device
    split: Split
    placement: PlacementState
    counters: Counters
    lane: lanes.CpuLane | None
    stage: Staging | None  # pinned buffers for the host's round trips (GPUs only)
    copy_stream: torch.cuda.Stream | None
    # [1] int32 on the device: the first intermediate row the lane computes of a miss split
    # by its rows (the GPU reads the rows before it); None where misses are not split so
    rows: torch.Tensor | None = field(init=False, default=None)
    # whether the expert kernels fetch the misses the device's books fill as they compute
    # them (FREETOKEN_FUSED_FETCH), where a layer's kernels can
    fused_fetch: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self.fused_fetch = self.cuda and config.current().fused_fetch
        if self.cuda and self.lane is not None:
            share = config.current().split_rows
            first = first_cpu_row(share, self.split, self.banks.spec.intermediate)
            if first:
                self.rows = torch.tensor([first], dtype=torch.int32, device=self.device)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def from_slots(
        self,
        layer: int,
        x: torch.Tensor,
        slots: torch.Tensor,
        weights: torch.Tensor,
        host: moe_gpu.HostRows | None = None,
        fill: moe_gpu.Fill | None = None,
    ):
        spec = self.banks.specs[layer]
        return moe_gpu.experts_from_slots(x, slots, weights, self.cache.slots, spec, host, fill)

    def fill(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, fetch: torch.Tensor
    ) -> moe_gpu.Fill | None:
        """The slots the books fill this step (`fetch`, DeviceLRU.assign's), for the expert
        kernels to fetch as they compute; None where a fetch kernel must copy them first."""
        banks = self.banks.banks[layer]
        spec = self.banks.specs[layer]
        if not self.fused_fetch or not moe_gpu.Fill.takes(x, self.cache.slots, spec, banks):
            return None
        return moe_gpu.Fill(banks, ids, fetch)

    def host_rows(self, layer: int, ids: torch.Tensor) -> moe_gpu.HostRows | None:
        """The GPU's part of this layer's misses split by their rows (None: not split)."""
        if self.rows is None or not moe_gpu.HostRows.takes(self.banks.specs[layer]):
            return None
        return moe_gpu.HostRows(self.banks.banks[layer], ids, self.rows)

    def account_device(self, layer: int, routes: int) -> None:
        """Counts a layer run on the device, eagerly or replayed (a capture counts nothing)."""
        if lanes.capturing(self.device):
            return
        # a CPU layer's routes are all misses: a token's top-k, every one on the CPU
        on_cpu = routes if self.placement.is_cpu(layer) else 0
        self.counters.account(on_cpu, 0, on_cpu)
        self.count_cpu_layer(layer, on_cpu)
        if layer in self.placement.fixed_layers:  # the device path counts its hits itself
            self.cache.hits[layer] += routes

    def count_cpu_layer(self, layer: int, misses: int) -> None:
        """A CPU layer's misses are the cache's too, as a fixed layer's routes are its hits:
        without them the cache's totals (/api/cache, the serving bench's bound) read every
        route hit while whole layers compute on the CPU. The same count as the backend's
        own: by route inside a decode step (a device-side count of distinct experts would
        cost a kernel a layer; at one token a route is an expert read), by expert read in
        an eager layer. No cache (every expert on the CPU): nothing to count against."""
        if misses and self.cache is not None:
            self.cache.misses[layer] += misses


def first_cpu_row(share: float | None, split: Split, intermediate: int) -> int:
    """The first intermediate row the CPU computes of a miss split by its rows: the GPU
    reads `share` of them from host memory (None: as the two paths' speeds an expert
    balance them, the CPU's time over both's), a whole number of the GPU kernel's row
    blocks; 0 where that leaves either path nothing (the miss is not split)."""
    if share is None:
        cpu, pcie = split.cpu.per_expert, split.fetch_s or split.pcie.per_expert
        share = cpu / (cpu + pcie)
    block = moe_gpu.ROW_BLOCK
    first = round(share * intermediate / block) * block
    return first if 0 < first < intermediate else 0


class CpuPath:
    def __init__(self, s: Shared):
        self.s = s

    def layer(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor):
        """A layer whose experts all run on the CPU: through the lane inside a decode step."""
        lane = self.s.lane
        if lane is not None and lane.serves(ids.shape[0]):
            self.s.account_device(layer, ids.numel())
            lane.start()
            lane.post(layer, x, ids, weights)
            return lane.collect(torch.zeros_like(x))
        T, k = ids.shape
        out = cpu_kernel.moe_experts(
            x.float().cpu(),
            self.s.banks.banks[layer],
            torch.arange(T).repeat_interleave(k),
            ids.reshape(-1).cpu(),
            weights.reshape(-1).float().cpu(),
            self.s.banks.specs[layer],
            compute_dtype=self.s.banks.dtype,
        )
        read = len(torch.unique(ids))  # the experts the CPU read: the layer's misses
        self.s.counters.account(read, 0, T * k)
        self.s.count_cpu_layer(layer, read)
        return out.to(device=x.device, dtype=x.dtype)

    def partial(
        self,
        layer: int,
        x: torch.Tensor,
        ids_h: np.ndarray,
        weights: torch.Tensor,
        cpu_experts: np.ndarray,
    ) -> torch.Tensor:
        """The routes to `cpu_experts`, computed from the host banks; fp32 [T, H]."""
        s = self.s
        sel = np.isin(ids_h, cpu_experts)
        tok, col = np.nonzero(sel)
        x_h = x.float().cpu()  # no copy where x is staged in host memory already
        w_h = weights.cpu().float()[torch.from_numpy(tok), torch.from_numpy(col)]
        exp = torch.from_numpy(ids_h[tok, col].astype(np.int64))
        # pinned, so the result goes back to the GPU without a staging copy
        out = None
        if s.stage is not None:
            out = s.stage.buf("partial", tuple(x_h.shape), torch.float32).zero_()
        t0 = time.perf_counter()
        result = cpu_kernel.moe_experts(
            x_h,
            s.banks.banks[layer],
            torch.from_numpy(tok.astype(np.int64)),
            exp,
            w_h,
            s.banks.specs[layer],
            out=out,
            compute_dtype=s.banks.dtype,
        )
        s.split.cpu.observe(len(cpu_experts), time.perf_counter() - t0)
        return result

    def add_partial(self, out: torch.Tensor, partial: torch.Tensor) -> torch.Tensor:
        return out + partial.to(device=self.s.device, dtype=out.dtype, non_blocking=self.s.cuda)


class HostBooksPath:
    """`choose(m, T)` is how many of a layer's m misses to fetch in a step of T tokens;
    `pull_activations` whether the CPU may compute some (so x and the weights come back
    with the routes, in the layer's one host round trip)."""

    def __init__(
        self, s: Shared, cpu: CpuPath, choose: Callable[[int, int], int], pull_activations: bool
    ):
        self.s, self.cpu, self.choose, self.pull_activations = s, cpu, choose, pull_activations
        self._fetch_times = CopyTimings()

    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor):
        s, t_enter = self.s, time.perf_counter()
        ids_h, x_h, w_h = self._pull(ids, x, weights)
        s.counters.time("sync_s", time.perf_counter() - t_enter)
        T = ids_h.shape[0]
        experts, counts = np.unique(ids_h, return_counts=True)
        slots = s.cache.lookup(layer, experts)
        miss = slots < 0
        m = int(miss.sum())
        # never fetch more than the pool can hold next to this step's hits and fixed experts
        room = s.cache.capacity - int((~miss).sum()) - int(s.cache.fixed.sum())
        q = min(self.choose(m, T), max(room, 0))
        order = np.flatnonzero(miss)[np.argsort(-counts[miss], kind="stable")]  # most-shared first
        fetch, on_cpu = order[:q], order[q:]
        if q:
            slots[fetch] = s.cache.allocate(layer, experts[fetch], slots[~miss])
            self._fetch(layer, experts[fetch], slots[fetch], q)
        slot_map = np.full(s.banks.num_experts, -1, dtype=np.int32)
        slot_map[experts] = slots  # CPU experts keep -1
        route_slots = torch.from_numpy(slot_map[ids_h]).to(s.device, non_blocking=s.cuda)
        if s.copy_stream is not None and q:
            torch.cuda.current_stream(s.device).wait_stream(s.copy_stream)
        out = s.from_slots(layer, x, route_slots, weights)
        s.cache.touch(slots)
        s.counters.account(m, q, len(on_cpu))
        if len(on_cpu):
            # The GPU part is queued and runs meanwhile. The CPU part runs on this thread, which
            # joins the kernel's thread team: a worker thread would leave the host thread fighting
            # the kernel's pinned threads for a core, and cost a hand-off per layer.
            t_wait = time.perf_counter()
            partial = self.cpu.partial(
                layer,
                x if x_h is None else x_h,
                ids_h,
                weights if w_h is None else w_h,
                experts[on_cpu],
            )
            s.counters.time("cpu_wait_s", time.perf_counter() - t_wait)
            out = self.cpu.add_partial(out, partial)
        s.counters.time("host_s", time.perf_counter() - t_enter)
        return out

    def _pull(self, ids: torch.Tensor, x: torch.Tensor, weights: torch.Tensor):
        """The routes in host memory (numpy), with x and the weights where the CPU may need
        them (None otherwise): the one host round trip of the layer."""
        stage = self.s.stage
        if stage is None:
            return ids.cpu().numpy(), None, None
        if self.pull_activations:
            ids_t, x_h, w_h = stage.pull(ids, x, weights)
            return ids_t.numpy(), x_h, w_h
        return stage.pull(ids)[0].numpy(), None, None

    def _fetch(self, layer: int, experts: np.ndarray, slots: np.ndarray, q: int) -> None:
        s = self.s
        if s.copy_stream is None:
            t0 = time.perf_counter()
            s.placement.copy_in(layer, experts, slots)
            s.split.pcie.observe(q, time.perf_counter() - t0)
            return
        # slots being overwritten may still be read by work already queued on the compute stream
        s.copy_stream.wait_stream(torch.cuda.current_stream(s.device))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(s.copy_stream):
            start.record()
            s.placement.copy_in(layer, experts, slots)
            end.record()
        self._fetch_times.record(q, start, end, s.split.pcie)


class DeviceBooksPath:
    def __init__(self, s: Shared, cpu: CpuPath):
        self.s, self.cpu = s, cpu
        self.lookahead: Lookahead | None = None  # set once the model's routers are known

    def __call__(
        self,
        layer: int,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        lru: DeviceLRU,
        split: bool,
    ) -> torch.Tensor:
        self.s.account_device(layer, ids.numel())
        if split:
            return self._split(layer, x, ids, weights, lru)
        ahead = self.lookahead
        if ahead is None:
            slots, fetch, _ = lru.assign(layer, ids)
            if (fill := self.s.fill(layer, x, ids, fetch)) is None:
                lru.fetch(layer, ids, fetch)
            return self.s.from_slots(layer, x, slots, weights, fill=fill)
        ahead.join(layer)
        slots = lru(layer, ids)
        if ahead.fits(lru, ids.numel()):  # the next layer's guessed experts, fetched meanwhile
            ahead.after(layer, x, lru)
        return self.s.from_slots(layer, x, slots, weights)

    def _split(self, layer, x, ids, weights, lru: DeviceLRU) -> torch.Tensor:
        """One token's layer with the books on the device: a share of the misses fetched by
        the GPU while the CPU computes the others. Through the CPU lane nothing here waits (the
        step stays one graph); otherwise the host waits for the books' answer (which routes
        are the CPU's), not for the fetch."""
        s, t_enter = self.s, time.perf_counter()
        slots, fetch, cpu = lru.assign(layer, ids, split=True)
        if s.lane is not None:
            host = s.host_rows(layer, ids)  # the rows of the CPU's misses the GPU reads
            fill = s.fill(layer, x, ids, fetch)
            s.lane.start()
            # the CPU starts on its routes (their rows from host.rows on) now
            s.lane.post(layer, x, ids, weights, cpu, host.rows if host else None)
            if fill is None:
                lru.fetch(layer, ids, fetch)
            return s.lane.collect(s.from_slots(layer, x, slots, weights, host, fill))
        staged = s.stage.pull_async(ids, cpu, x, weights) if s.stage is not None else None
        lru.fetch(layer, ids, fetch)  # queued after the copies the host waits for
        out = s.from_slots(layer, x, slots, weights)
        if staged is not None:
            s.stage.wait()
            ids_t, cpu_t, x, weights = staged
        else:
            ids_t, cpu_t = ids.cpu(), cpu.cpu()
        s.counters.time("sync_s", time.perf_counter() - t_enter)
        ids_h, cpu_h = ids_t.numpy(), cpu_t.numpy()
        if cpu_h.any():
            t_wait = time.perf_counter()
            partial = self.cpu.partial(layer, x, ids_h, weights, ids_h.reshape(-1)[cpu_h])
            s.counters.time("cpu_wait_s", time.perf_counter() - t_wait)
            out = self.cpu.add_partial(out, partial)
        s.counters.steps["cpu_routes"] += int(cpu_h.sum())
        s.counters.time("host_s", time.perf_counter() - t_enter)
        return out
