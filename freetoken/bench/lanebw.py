"""`freetoken bench bw`'s CPU lane rows: the expert kernel served through the lane (the
mailbox a decode step's graph posts into), at a split's few routes a request and at a
token's eight, alone and beside a process that wakes as a streaming server's do: what the lane
and its neighbours cost against the kernel called directly.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from freetoken.kernels import cpu as cpu_kernel
from freetoken.moe import lane as lanes
from freetoken.moe.banks import HostBanks

TOP_K = 8  # a token's routes in the benchmark's shape (Qwen3-30B-A3B)


# A neighbour as a streaming server has: each token wakes the runner's event loop, the HTTP
# process and the client for a few hundred microseconds of Python each.
NEIGHBOUR = """
import time
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < 200e-6:
        pass
    time.sleep(300e-6)
"""
SPLIT_ROUTES = 2  # a split's CPU routes a request (served: 1.8-3.2 of top-8)


def measure_lane(banks: Any, seconds: float, routes: int, threads: int = 0) -> float:
    """GB/s of the experts the CPU lane read over the time its loop spent serving them
    (`cpu_us_per_request`, as /api/cache reports it), requests of `routes` routes posted from
    here through the CPU-only mailbox, a pause between them as a GPU's share of a layer
    leaves; `threads` as CpuLane takes it."""
    host = {(i, b): t for i, layer in enumerate(banks.layers) for b, t in layer.items()}
    formats = {k: banks.spec.format_of(k[1]) for k in host if banks.spec.format_of(k[1])}
    lane = lanes.CpuLane(
        HostBanks(host, torch.bfloat16, pin=False, spec=banks.spec, formats=formats),
        torch.device("cpu"),
        threads,
    )
    rng = np.random.default_rng(3)
    experts, hidden = banks.layers[0]["down"].shape[:2]
    x, w = torch.randn(1, hidden), torch.full((1, routes), 1.0 / routes)
    lane.start()
    try:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            ids = torch.from_numpy(rng.choice(experts, routes, replace=False).astype(np.int64))
            lane.post(int(rng.integers(len(banks.layers))), x, ids[None], w)
            lane.collect(torch.zeros(1, hidden))
            time.sleep(300e-6)
        s = lane.stats()
    finally:
        lane.stop()
    return s["routes_per_request"] * banks.expert_bytes / s["cpu_us_per_request"] / 1e3


def measure_lanes(banks: Any, seconds: float, called: Callable[..., float]) -> dict:
    """The kernel called directly (`called(seconds, routes=...)`: bw.measure_cpu on these
    banks) and through the lane at a split's routes, alone and beside a busy neighbour, the
    lane on every core but one (as served) and on every core."""
    cores = len(cpu_kernel.physical_cpus())
    out = {
        "cpu_split_gbps": called(seconds, routes=SPLIT_ROUTES),
        "lane_gbps": measure_lane(banks, seconds, TOP_K),
        "lane_split_gbps": measure_lane(banks, seconds, SPLIT_ROUTES),
    }
    neighbour = subprocess.Popen([sys.executable, "-c", NEIGHBOUR])
    try:
        time.sleep(0.2)
        out["cpu_split_busy_gbps"] = called(seconds, routes=SPLIT_ROUTES)
        out["lane_split_busy_gbps"] = measure_lane(banks, seconds, SPLIT_ROUTES)
        out["lane_split_busy_all_gbps"] = measure_lane(banks, seconds, SPLIT_ROUTES, cores)
    finally:
        neighbour.kill()
        neighbour.wait()
    return out | {"lane_threads": len(lanes.lane_cpus(list(range(cores)))), "cores": cores}


def lane_rows(lane: dict, cpu_gbps: float) -> list[dict]:
    """The lane's rows, each against the row it is to be read with."""
    n, busy, alone = SPLIT_ROUTES, "beside a busy process", lane["lane_split_gbps"]
    rows = [
        ("CPU lane, 8 routes a request", lane["lane_gbps"], cpu_gbps, "the kernel called"),
        (f"CPU kernel, {n} routes a call", lane["cpu_split_gbps"], cpu_gbps, "8 routes"),
        (f"CPU lane, {n} routes a request", alone, lane["cpu_split_gbps"], "the kernel called"),
        (
            f"CPU kernel, {n} routes, {busy}",
            lane["cpu_split_busy_gbps"],
            lane["cpu_split_gbps"],
            "alone",
        ),
        (f"CPU lane, {n} routes, {busy}", lane["lane_split_busy_gbps"], alone, "alone"),
        (
            f"CPU lane on every core, {n} routes, {busy}",
            lane["lane_split_busy_all_gbps"],
            alone,
            "the lane alone, as served",
        ),
    ]
    note = f"lane: {lane['lane_threads']} of {lane['cores']} cores unless every core"
    return [
        {
            "path": path,
            "gbps": gbps,
            "note": f"{gbps / ref:.2f}x {than}" + (f"; {note}" if i == 0 else ""),
        }
        for i, (path, gbps, ref, than) in enumerate(rows)
    ]
