"""B_P and B_H timed at a model's first load on a machine that has no bandwidth profile yet.

Until `freetoken bench bw` had run, a runner started from 20 GB/s for both; on the H200
machine the measured figures were 48-55 GB/s over PCIe and 40-97 GB/s for the CPU kernel, so
on a fresh install the split's starting share, adaptive's predicted placement, `freetoken
doctor`'s expected speed and the bound `bench serve` prints all started from guesses. The
load now times the model's own pinned banks for a fraction of a second each way, before the
cache is filled, and keeps the figures as this machine's profile (marked as the load's:
`bench bw`, which measures longer and more, replaces them).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from freetoken.kernels import cpu as cpu_kernel
from freetoken.moe import profile
from freetoken.moe.banks import HostBanks
from freetoken.moe.cache import ExpertCache, expert_part

__all__ = ["SECONDS", "cpu_gbps", "pcie_gbps", "store"]

SECONDS = 0.2  # each way, after one untimed round
ROUTES = 8  # experts a round: one token's top-k, as a decode step's misses come


def _rounds(seconds: float, one_round) -> float:
    """Bytes a second over rounds of `one_round()` (which returns its bytes) for `seconds`,
    after one untimed round (a first call's page faults and thread start-up)."""
    one_round()
    moved, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds:
        moved += one_round()
    return moved / max(elapsed, 1e-9)


def cpu_gbps(host: HostBanks, seconds: float = SECONDS) -> float:
    """The CPU expert kernel's GB/s on these banks: one token's routes a call, as a
    decode step's CPU misses are computed."""
    rng = np.random.default_rng(0)
    k = min(ROUTES, host.num_experts)
    x = torch.randn(1, host.spec.hidden)
    tok, w = torch.zeros(k, dtype=torch.int64), torch.full((k,), 1.0 / k)

    def one_round() -> int:
        layer = host.layers[int(rng.integers(len(host.layers)))]
        exp = torch.from_numpy(rng.choice(host.num_experts, k, replace=False).astype(np.int64))
        cpu_kernel.moe_experts(
            x, host.banks[layer], tok, exp, w, host.specs[layer], compute_dtype=host.dtype
        )
        return k * host.expert_bytes

    return _rounds(seconds, one_round) / 1e9


def pcie_gbps(
    host: HostBanks, cache: ExpertCache, device: torch.device, seconds: float = SECONDS
) -> float:
    """GB/s of experts copied from the host banks into the first slots of an empty cache,
    a top-k of random experts at a time, as misses are fetched."""
    rng = np.random.default_rng(1)
    k = min(ROUTES, host.num_experts, cache.capacity)
    stream = torch.cuda.Stream(device)

    def one_round() -> int:
        layer = host.layers[int(rng.integers(len(host.layers)))]
        for j, e in enumerate(rng.choice(host.num_experts, k, replace=False).tolist()):
            for bank, src in host.banks[layer].items():
                host.h2d(expert_part(cache.slots[bank], j, src[e]), src[e], True)
        stream.synchronize()
        return k * host.expert_bytes

    with torch.cuda.device(device), torch.cuda.stream(stream):
        return _rounds(seconds, one_round) / 1e9


def store(cache_dir, fmt: str, pcie: float, cpu: float) -> None:
    """Adds the load's figures (GB/s) to this machine's profile, B_H under the banks' block
    format (fmt, "" for float banks); a profile that cannot be written costs the next load
    another probe."""
    known = profile.load(cache_dir) or {"source": "load"}
    known |= {"pcie_gbps": pcie, f"cpu_expert_gbps{'_' + fmt if fmt else ''}": cpu}
    try:
        profile.save(cache_dir, known)
    except OSError:
        pass
