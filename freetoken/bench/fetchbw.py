"""The fetch kernel's PCIe bandwidth: what a miss costs a decode step whose books are on the device.

B_P (bench bw) is timed with the copy engine, eight experts a batch. A decode step with
the cache's books on the device fetches each layer's misses with a GPU kernel that reads
the pinned banks itself (kernels/triton/fetch.py), most often one expert at a time: its
bandwidth, and its time a call, are what a miss adds to such a step. Measured here at one
expert a call and at a token's top-k, from banks far larger than any cache, into slots,
a layer's banks a launch as a step fetches them; and a call with nothing to fetch, which a
captured step still launches in every layer whose routes all hit.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch

from freetoken.kernels import moe_gpu

CALLS_AHEAD = 64  # calls queued before the host waits: launches stay ahead of the GPU
EXPERTS_DRAWN = 4096  # random experts drawn once, on the device, read in turn
GRAPH_CALLS = 32  # idle calls one captured graph holds


class HasBanks(Protocol):
    layers: list[dict[str, torch.Tensor]]  # bank name -> [E, ...] pinned host tensor
    expert_bytes: int


def measure_fetch(banks: HasBanks, seconds: float, routes: int, device: str = "cuda") -> dict:
    """{"gbps", "us_per_call"}: `routes` experts of random layers fetched a call, into
    `routes` slots, for about `seconds`."""
    dev = torch.device(device)
    first = banks.layers[0]
    num_experts = next(iter(first.values())).shape[0]
    slots = {
        n: torch.empty((routes, *b.shape[1:]), dtype=b.dtype, device=dev) for n, b in first.items()
    }
    rng = np.random.default_rng(2)
    drawn = np.stack([rng.choice(num_experts, routes, replace=False) for _ in range(EXPERTS_DRAWN)])
    experts = torch.from_numpy(drawn.astype(np.int32)).to(dev)
    into = torch.arange(routes, dtype=torch.int32, device=dev)

    def call(n: int) -> None:
        layer = banks.layers[int(rng.integers(len(banks.layers)))]
        pairs = [(src, slots[name]) for name, src in layer.items()]
        moe_gpu.fetch_banks(pairs, experts[n % EXPERTS_DRAWN], into)

    calls, elapsed = _timed(dev, seconds, call)
    return {
        "gbps": calls * routes * banks.expert_bytes / elapsed / 1e9,
        "us_per_call": elapsed / calls * 1e6,
    }


def measure_idle(banks: HasBanks, seconds: float, routes: int, device: str = "cuda") -> float:
    """Microseconds a call of the fetch with `routes` routes, none of them to be fetched
    (every slot -1): what the fetch costs a layer whose routes all hit. On a GPU the calls
    are replayed from a CUDA graph, as a step's are: launched from Python one at a time they
    read 27.6-28.2 µs a call on the H100 machine at 8 routes and 27.7-34.2 at 32, which looks
    like the launcher's time rather than the device's."""
    dev = torch.device(device)
    first = banks.layers[0]
    pairs = [(b, torch.empty((1, *b.shape[1:]), dtype=b.dtype, device=dev)) for b in first.values()]
    experts = torch.zeros(routes, dtype=torch.int64, device=dev)  # a router's ids, as a step's
    none = torch.full((routes,), -1, dtype=torch.int32, device=dev)

    def call(_: int) -> None:
        moe_gpu.fetch_banks(pairs, experts, none)

    if dev.type != "cuda":
        calls, elapsed = _timed(dev, seconds, call)
        return elapsed / calls * 1e6
    call(0)  # compiled before the capture
    _sync(dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for n in range(GRAPH_CALLS):
            call(n)
    calls, elapsed = _timed(dev, seconds, lambda _: graph.replay())
    return elapsed / (calls * GRAPH_CALLS) * 1e6


def _timed(dev: torch.device, seconds: float, call: Callable[[int], None]) -> tuple[int, float]:
    """(calls, seconds they took): call(0), call(1), ... for about `seconds`, timed on the
    device between events, the host waiting every CALLS_AHEAD calls. One call first, untimed:
    each routes-a-call count is its own compiled kernel, and a compile inside the window was
    timed as device time (one expert a call read 2.5 s a call on the H100 machine)."""
    call(0)
    _sync(dev)
    calls, t0 = 0, time.perf_counter()
    start, end = _event(dev), _event(dev)
    _record(start)
    while time.perf_counter() - t0 < seconds:
        call(calls)
        calls += 1
        if calls % CALLS_AHEAD == 0:
            _sync(dev)
    _record(end)
    _sync(dev)
    elapsed = start.elapsed_time(end) / 1e3 if start is not None else time.perf_counter() - t0
    return calls, elapsed


def _event(dev: torch.device) -> torch.cuda.Event | None:
    return torch.cuda.Event(enable_timing=True) if dev.type == "cuda" else None


def _record(event: torch.cuda.Event | None) -> None:
    if event is not None:
        event.record()


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def rows(fetch: dict[int, dict], b_p: float, idle: dict[int, float] | None = None) -> list[dict]:
    """bench bw's table rows: each routes-a-call figure against the copy engine's B_P, then
    each idle call's time (routes: microseconds)."""
    out = [
        {
            "path": f"PCIe fetch kernel, {n} expert{'s' * (n > 1)} a call",
            "gbps": f["gbps"],
            "note": f"{f['us_per_call']:.0f} us a call; {f['gbps'] / b_p:.2f}x B_P",
        }
        for n, f in fetch.items()
    ]
    return out + [
        {
            "path": f"PCIe fetch kernel, {n} routes, nothing to fetch",
            "gbps": 0.0,
            "note": f"{us:.1f} us a call (a layer's banks, one launch)",
        }
        for n, us in (idle or {}).items()
    ]
