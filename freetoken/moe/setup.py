"""Placing a model's experts: host banks, the GPU slot budget, and the experts op backend."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from freetoken import config
from freetoken.ftw import hostmem
from freetoken.models.base import ExpertSpec, uniform_spec
from freetoken.moe import probe, profile
from freetoken.moe.backend import attach
from freetoken.moe.banks import HostBanks
from freetoken.moe.budget import ACTIVATION_RESERVE
from freetoken.moe.cache import ExpertCache
from freetoken.moe.dispatch import Split
from freetoken.moe.hotset import HotSet
from freetoken.moe.learned import Learned
from freetoken.moe.offload import OffloadExperts
from freetoken.moe.policy import Policy
from freetoken.weights import BankKey, WeightsError

log = logging.getLogger(__name__)


@dataclass
class Placement:
    """How a model's experts are to be placed (from settings and the request's options)."""

    policy: str
    vram_budget: int  # bytes; 0 = the free memory of the device
    cache_dir: object = None
    # an explicit slot count instead of the budget (tests; on the CPU, a host-memory pool)
    slots: int = 0
    # decode keeps the cache's books on the device: auto (on GPUs), on, off
    device_cache: str = "auto"
    # adaptive's CPU routes of single-token steps through the CPU lane: auto (on GPUs), on, off
    cpu_lane: str = "auto"
    # the model's weights, named (the hot set kept across loads is theirs); "": none kept
    model_key: str = ""
    # device-kept books fetch the next layer's guessed experts ahead: on, off
    lookahead: str = "off"

    def switch(self, setting: str, device: torch.device, ranks_on_host: int) -> bool:
        """An auto/on/off setting for one process: auto means on GPUs. The device-kept books
        and the lane serve one process's whole cache and the whole host's cores; ranks route
        a token's experts to several processes, each with a few rows."""
        on = setting == "on" or (setting == "auto" and device.type == "cuda")
        return ranks_on_host == 1 and on


def cache_slots(
    budget: int, expert_bytes: int, num_layers: int, num_experts: int, device: torch.device
) -> int:
    """How many experts fit in what the budget leaves after weights and KV are allocated."""
    used = torch.cuda.memory_allocated(device)
    if budget <= 0:
        free, _ = torch.cuda.mem_get_info(device)
        budget = used + int(free * 0.92)
    room = budget - used - ACTIVATION_RESERVE
    slots = min(room // expert_bytes, num_layers * num_experts)
    if slots < num_experts:
        raise WeightsError(
            f"the VRAM budget of {budget / 2**30:.1f} GiB leaves room for {max(slots, 0)} experts; "
            f"at least {num_experts} (one layer's) are needed"
        )
    return int(slots)


def expert_spec(model: nn.Module) -> ExpertSpec:
    """The one ExpertSpec of the model's MoE layers (every kernel takes one per backend)."""
    try:
        return uniform_spec(model.expert_specs())
    except ValueError as e:
        raise WeightsError(str(e)) from None


def install(
    model: nn.Module,
    banks: dict[BankKey, torch.Tensor],
    device: torch.device,
    dtype: torch.dtype,
    placement: Placement,
    formats: dict[BankKey, str] | None = None,
) -> OffloadExperts:
    backend = build(banks, expert_spec(model), device, dtype, placement, formats=formats)
    attach(model, backend, backend.banks.layers)
    return backend


def build(
    banks: dict[BankKey, torch.Tensor],
    spec: ExpertSpec,
    device: torch.device,
    dtype: torch.dtype,
    placement: Placement,
    ranks_on_host: int = 1,
    formats: dict[BankKey, str] | None = None,
) -> OffloadExperts:
    """The offload backend over `banks` (packed where `formats` names a block format): every
    expert, or one rank's share of them.

    `ranks_on_host` backends run side by side on one machine (freetoken.dist): each has its
    own GPU and PCIe link, but they share the host's DRAM bandwidth and cores, so each
    starts its split from an equal share of B_H.
    """
    policy = Policy.parse(placement.policy)  # an unknown policy fails before banks are pinned
    host = HostBanks(banks, dtype, pin=device.type == "cuda", spec=spec, formats=formats)
    cache = None
    slots = placement.slots
    # A slot count sizes the cache; the resident policy asks for every expert on the GPU
    # instead, so it sizes from the VRAM budget (and fails there if they do not fit).
    if device.type == "cuda" and (not slots or policy is Policy.RESIDENT):
        slots = cache_slots(
            placement.vram_budget, host.slot_bytes, len(host.layers), host.num_experts, device
        )
    slots = min(slots, len(host.layers) * host.num_experts)  # more than every expert is waste
    if slots:
        L, E = max(host.layers) + 1, host.num_experts
        cache = ExpertCache(L, E, slots, host.rows, host.dtypes, device)
    b_p, b_h, source = _start_bandwidths(placement, host, cache, device, ranks_on_host)
    fetch = _fetch_bandwidth(placement, host, device)
    split = Split.from_bandwidths(host.expert_bytes, b_p, b_h, fetch)
    # GPU kernels read pinned banks in place (the device-kept books' fetch, the lane's
    # buffers); pageable banks are reached only through the staging ring's copies.
    backend = OffloadExperts(
        host,
        cache,
        placement.policy,
        split,
        device,
        device_lru=host.pinned and placement.switch(placement.device_cache, device, ranks_on_host),
        cpu_lane=host.pinned and placement.switch(placement.cpu_lane, device, ranks_on_host),
        learned=_learned(placement, host, ranks_on_host),
        hot=_hot(placement, ranks_on_host),
        lookahead=placement.switch(placement.lookahead, device, ranks_on_host),
    )
    log.info(
        "experts: policy %s, %s slots of %.1f MiB%s, B_P %.1f GB/s B_H %.1f GB/s (%s)",
        placement.policy,
        cache.capacity if cache else 0,
        host.slot_bytes / 2**20,
        _formats_note(host),
        b_p / 1e9,
        b_h / 1e9,
        source,
    )
    return backend


def _start_bandwidths(
    placement: Placement,
    host: HostBanks,
    cache: ExpertCache | None,
    device: torch.device,
    ranks_on_host: int,
) -> tuple[float, float, str]:
    """B_P and B_H (bytes/s) the split starts from, and where they came from: this
    machine's profile; else, timed on this model's banks before its cache is filled and
    kept as the profile (one process alone on the host: ranks side by side share its DRAM
    and cores, and timed at once each would see and store a fraction of them); else the
    defaults."""
    b_p, b_h, measured = _bandwidths(placement, host.main_format)
    source = "measured" if measured else "defaults until `freetoken bench bw` runs"
    alone = ranks_on_host == 1 and device.type == "cuda" and host.pinned and cache is not None
    if not measured and placement.cache_dir and alone:
        pcie, cpu = probe.pcie_gbps(host, cache, device), probe.cpu_gbps(host)
        probe.store(placement.cache_dir, host.main_format, pcie, cpu)
        b_p, b_h, source = pcie * 1e9, cpu * 1e9, "timed at this load"
    b_h /= ranks_on_host
    if not host.pinned and device.type == "cuda":
        b_p = _staged(host, device, b_p, measured)
    return b_p, b_h, source


def _staged(host: HostBanks, device: torch.device, b_p: float, measured: bool) -> float:
    """B_P through the staging ring, measured now, and the warning that says what it costs."""
    staged = host.ring.measure(device)
    log.warning(
        "%s: expert banks stay pageable and misses reach the GPU through a %d MiB pinned "
        "staging ring at %.1f GB/s (pinned: %.1f GB/s%s); raise the memlock limit "
        "(ulimit -l unlimited, LimitMEMLOCK=infinity) to pin them",
        hostmem.refused(),
        host.ring.nbytes >> 20,
        staged / 1e9,
        b_p / 1e9,
        "" if measured else ", a default until `freetoken bench bw` runs",
    )
    return min(b_p, staged)


def _hot(placement: Placement, ranks_on_host: int) -> HotSet | None:
    """Where the cache's contents are kept across loads: one process's whole cache only (a
    rank's share of the experts is not the model's)."""
    if not placement.cache_dir or not placement.model_key or ranks_on_host != 1:
        return None
    return HotSet(placement.cache_dir, placement.model_key)


def _learned(placement: Placement, host: HostBanks, ranks_on_host: int) -> Learned | None:
    """Where adaptive keeps what it learns about these experts on this machine."""
    if not placement.cache_dir:
        return None
    shape = f"{len(host.layers)}x{host.num_experts}x{host.expert_bytes}-r{ranks_on_host}"
    return Learned(placement.cache_dir, f"{shape}-{_lane_key()}")


def _lane_key() -> str:
    """The settings that set the CPU lane's speed: a placement measured with another team
    is not this one's (through the server at 8 GiB a load on the whole team started in the
    whole CPU layers a load on half the team had chosen, where split on the whole team
    served a third more tokens, docs/benchmarks.md)."""
    cfg = config.current()
    teams = "_".join(f"{t:g}" for t in cfg.lane_teams)
    return f"c{cfg.cpu_threads}-t{teams}-g{int(cfg.lane_give_way)}"


def _bandwidths(placement: Placement, fmt: str) -> tuple[float, float, bool]:
    """(B_P, B_H) in bytes/s from this machine's stored profile (B_H for the banks' main block
    format), and whether it was measured."""
    if placement.cache_dir:
        return profile.bandwidths(placement.cache_dir, fmt)
    return profile.DEFAULT_PCIE_GBPS * 1e9, profile.DEFAULT_CPU_GBPS * 1e9, False


def _fetch_bandwidth(placement: Placement, host: HostBanks, device: torch.device) -> float | None:
    """The fetch kernel's bytes/s from this machine's profile, where a GPU reads the pinned
    banks itself."""
    if not placement.cache_dir or device.type != "cuda" or not host.pinned:
        return None
    gbps = profile.fetch_gbps(placement.cache_dir)
    return gbps * 1e9 if gbps else None


def _formats_note(host: HostBanks) -> str:
    fmts = sorted({f for s in host.specs.values() for f in s.formats if f})
    return f" ({'/'.join(fmts)})" if fmts else ""
