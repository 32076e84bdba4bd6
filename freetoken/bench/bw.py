"""`freetoken bench bw`: the two bandwidths the split is built on, measured on real paths.

B_P: host->GPU expert gather from pinned banks into cache slots (the fetch path), by the
copy engine; and the fetch kernel that device-kept books use, a miss at a time.
B_H: the CPU expert kernel on experts read from DRAM (banks far larger than the caches),
in BF16 and in each block format (GB/s of the bytes it reads, experts/s against BF16's; a
BF16 model's int8 activations, the default for quantized models, and fp32 ones).
Each alone and both at once (they share the host's DRAM). The result is stored as this
machine's profile; runners start their split from it.
The same kernel through the CPU lane, at a split's few routes a request, alone and beside a
process that wakes as a streaming server's do: what the lane and its neighbours cost.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Callable
from functools import partial

import numpy as np
import torch

from freetoken import quant
from freetoken.bench import common, fetchbw, lanebw, packed
from freetoken.ftw import hostmem
from freetoken.kernels import cpu as cpu_kernel
from freetoken.models.base import ExpertSpec
from freetoken.moe import profile

E, H, I, K = 128, 2048, 768, 8  # Qwen3-30B-A3B experts, top-8


def _bank(shape: tuple[int, ...], pin: bool, seed: int) -> torch.Tensor:
    n = int(np.prod(shape))
    buf = hostmem.HostBuffer(n * 2, hostmem.huge_pages_pay_here())  # the pages a load would use
    t = buf.tensor("bfloat16", list(shape), n * 2)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # random numbers are far faster on a GPU
    g = torch.Generator(device=dev).manual_seed(seed)
    t.copy_(torch.randn(shape, generator=g, device=dev).mul_(0.02).to(torch.bfloat16))
    if pin:
        buf.pin()
    return t


class Banks:
    """Enough layers of host banks that a run never reads the same expert from the CPU caches."""

    def __init__(self, layers: int, pin: bool):
        self.spec = ExpertSpec(H, I)
        self.layers = [
            {"gate_up": _bank((E, 2 * I, H), pin, 2 * i), "down": _bank((E, H, I), pin, 2 * i + 1)}
            for i in range(layers)
        ]
        self.expert_bytes = (2 * I * H + H * I) * 2


def measure_pcie(
    banks: Banks, seconds: float, stop: threading.Event | None = None, device: str = "cuda"
) -> float:
    dev = torch.device(device)
    slots = (
        torch.empty((64, 2 * I, H), dtype=torch.bfloat16, device=dev),
        torch.empty((64, H, I), dtype=torch.bfloat16, device=dev),
    )
    stream = torch.cuda.Stream(dev)
    rng = np.random.default_rng(0)
    moved, t_end = 0, time.perf_counter() + seconds
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    with torch.cuda.device(dev), torch.cuda.stream(stream):
        start.record()
        while time.perf_counter() < t_end and not (stop and stop.is_set()):
            layer = banks.layers[rng.integers(len(banks.layers))]
            for j, e in enumerate(rng.choice(E, K, replace=False)):
                slots[0][j].copy_(layer["gate_up"][e], non_blocking=True)
                slots[1][j].copy_(layer["down"][e], non_blocking=True)
            moved += K * banks.expert_bytes
            stream.synchronize()
        end.record()
    end.synchronize()
    return moved / (start.elapsed_time(end) / 1e3) / 1e9


def measure_cpu(
    banks: Banks,
    seconds: float,
    isa: str | None = None,
    stop: threading.Event | None = None,
    compute_dtype: torch.dtype = torch.bfloat16,
    routes: int = K,
    experts: int | None = None,
) -> float:
    rng = np.random.default_rng(1)
    experts = experts or E
    x = torch.randn(1, H)
    tok = torch.zeros(routes, dtype=torch.long)
    w = torch.full((routes,), 1.0 / routes)
    moved, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds and not (stop and stop.is_set()):
        layer = banks.layers[rng.integers(len(banks.layers))]
        exp = torch.from_numpy(rng.choice(experts, routes, replace=False).astype(np.int64))
        cpu_kernel.moe_experts(
            x, layer, tok, exp, w, banks.spec, isa=isa, compute_dtype=compute_dtype
        )
        moved += routes * banks.expert_bytes
    return moved / (time.perf_counter() - t0) / 1e9


def measure_torch_cpu(banks: Banks, seconds: float) -> float:
    """Plain torch on the same work, for the ratio against a simple implementation."""
    from freetoken.kernels import reference

    rng = np.random.default_rng(2)
    x = torch.randn(1, H).to(torch.bfloat16)
    moved, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        layer = banks.layers[rng.integers(len(banks.layers))]
        ids = torch.from_numpy(rng.choice(E, K, replace=False).astype(np.int64)).view(1, K)
        w = torch.full((1, K), 1.0 / K, dtype=torch.bfloat16)
        reference.moe_experts(x, ids, w, layer, banks.spec)
        moved += K * banks.expert_bytes
    return moved / (time.perf_counter() - t0) / 1e9


def measure_dram(seconds: float) -> float:
    # 2 GiB on the pages the banks are on, so that the kernels' fraction of it compares like
    # with like
    buf = hostmem.HostBuffer(1 << 31, hostmem.huge_pages_pay_here())
    a = buf.tensor("float32", [1 << 29], 1 << 31).fill_(1.0)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a.sum()
        n += a.numel() * 4
    return n / (time.perf_counter() - t0) / 1e9


def concurrent(banks: Banks, seconds: float) -> tuple[float, float]:
    out: dict[str, float] = {}
    t = threading.Thread(target=lambda: out.__setitem__("cpu", measure_cpu(banks, seconds)))
    t.start()
    out["pcie"] = measure_pcie(banks, seconds)
    t.join()
    return out["pcie"], out["cpu"]


# Banks of each block format are made on the CPU, which took the eight formats past 100 s at
# 8 GiB each on the GPU machine; 2 GiB is still many times any CPU's last-level cache.
FORMAT_GIB = 2.0


def at_threads(threads: list[int], measure: Callable[[], float]) -> dict[int, float]:
    """`measure()` with torch's thread pool (the kernel's) at each count. A kernel bound by
    DRAM stops gaining threads well before the core count; one still gaining at every core
    is bound by each core: its instructions, or its own waits on memory."""
    before = torch.get_num_threads()
    out = {}
    try:
        for n in threads:
            torch.set_num_threads(n)
            measure()  # the pool grows to n and the banks' pages are warm in the TLB
            out[n] = measure()
    finally:
        torch.set_num_threads(before)
    return out


def measure_formats(
    formats: list[str],
    seconds: float,
    gib: float,
    bf16_gbps: float,
    threads: list[int] = (),
    prefetch: list[int] = (),
    isa: str | None = None,
) -> dict:
    """The CPU kernel on banks of each block format (as large as the BF16 ones, up to
    FORMAT_GIB): GB/s of the packed bytes it reads, experts/s, and experts/s against BF16's
    (the bound moves by that), for a BF16 model (int8 activations where the CPU has a kernel);
    `exact_gbps` with the fp32 activations of an fp32 model; `hot_gbps` on one layer's 8
    experts called again and again (tens of MB, in the last-level cache where it is that
    large: the kernel's own speed, so whether DRAM or the kernel holds `gbps` back);
    `by_threads` at each of `threads`; `by_prefetch` with the int8 kernels asking each of
    `prefetch` bytes ahead."""
    bf16_rate = bf16_gbps * 1e9 / ((2 * I * H + H * I) * 2)
    out = {}
    for fmt in formats:
        per = packed.PackedBanks.make(fmt, E, H, I, 1).expert_bytes
        layers = max(2, int(min(gib, FORMAT_GIB) * 2**30 // (E * per)))
        banks = packed.PackedBanks.make(fmt, E, H, I, layers)
        measure = partial(measure_cpu, banks, isa=isa)
        measure(0.3)
        gbps = measure(seconds)
        exact = measure(seconds / 2, compute_dtype=torch.float32)
        rate = gbps * 1e9 / banks.expert_bytes
        hot = packed.PackedBanks.make(fmt, K, H, I, 1)
        measure_cpu(hot, 0.2, isa, experts=K)
        hot_gbps = measure_cpu(hot, seconds / 2, isa, experts=K)
        out[fmt] = {
            "gbps": gbps,
            "experts_per_s": rate,
            "vs_bf16": rate / bf16_rate,
            "exact_gbps": exact,
            "hot_gbps": hot_gbps,
            "by_threads": at_threads(list(threads), partial(measure, seconds / 2)),
            "by_prefetch": by_prefetch(prefetch, threads, partial(measure, seconds / 2)),
        }
        if cpu_kernel.extension() is not None:  # a split's few routes, called and through the lane
            split = lanebw.SPLIT_ROUTES
            out[fmt]["cpu_split_gbps"] = measure(seconds / 2, routes=split)
            out[fmt]["lane_split_gbps"] = lanebw.measure_lane(banks, seconds / 2, split)
        del banks
    return out


def by_prefetch(
    prefetch: list[int], threads: list[int], measure: Callable[[], float]
) -> dict[int, dict[int, float]]:
    """{bytes ahead: {threads: GB/s}}: the int8 kernels' software prefetch set to each
    distance in turn (at `threads`, or the default count), then put back."""
    ext = cpu_kernel.extension()
    if not prefetch or ext is None:
        return {}
    counts = list(threads) or [torch.get_num_threads()]
    out, last = {}, ext.quant_set_prefetch_bytes(0)
    try:
        for ahead in prefetch:
            ext.quant_set_prefetch_bytes(ahead)
            out[ahead] = at_threads(counts, measure)
    finally:
        ext.quant_set_prefetch_bytes(last)
    return out


def run(
    seconds: float = 3.0,
    gib: float = 8.0,
    formats: list[str] | None = None,
    threads: list[int] = (),
    prefetch: list[int] = (),
    isa: str | None = None,
) -> dict:
    """Every measurement; `isa` holds the CPU kernels to that tier (cpu.TIERS) where they
    are called directly (the lane's rows keep the CPU's best)."""
    cuda = torch.cuda.is_available()
    layers = max(2, int(gib * 2**30 // (E * 3 * I * H * 2)))
    banks = Banks(layers, pin=cuda)
    measure_cpu(banks, 0.5, isa)  # warm-up: compiles the kernel, spins up threads
    result = {
        "cpu_kernel": isa or cpu_kernel.tier(),
        "threads": torch.get_num_threads(),
        "cpu_expert_gbps": measure_cpu(banks, seconds, isa),
        "torch_cpu_expert_gbps": measure_torch_cpu(banks, seconds / 2),
        "dram_read_gbps": measure_dram(seconds / 2),
        "bank_gib": layers * E * banks.expert_bytes / 2**30,
        "by_threads": at_threads(list(threads), partial(measure_cpu, banks, seconds / 2, isa)),
    }
    if cpu_kernel.extension() is not None:
        result["lane"] = lanebw.measure_lanes(banks, seconds / 2, partial(measure_cpu, banks))
    if cuda:
        measure_pcie(banks, 0.5)
        result["pcie_gbps"] = measure_pcie(banks, seconds)
        result["fetch"] = {n: fetchbw.measure_fetch(banks, seconds / 2, n) for n in (1, K)}
        # a step of one token and of four streams whose routes all hit
        result["fetch_idle_us"] = {n: fetchbw.measure_idle(banks, 0.5, n) for n in (K, 4 * K)}
        result["pcie_concurrent_gbps"], result["cpu_concurrent_gbps"] = concurrent(banks, seconds)
    del banks
    per_format = measure_formats(
        formats or [], seconds, gib, result["cpu_expert_gbps"], threads, prefetch, isa
    )
    return with_formats(result, per_format)


def with_formats(result: dict, per_format: dict) -> dict:
    """`result` with the block formats' measurements added (measure_formats), and each one's
    B_H as the profile keeps it: runners of a packed model start their split from it."""
    out = {**result, "formats": {**result.get("formats", {}), **per_format}}
    return out | {f"cpu_expert_gbps_{fmt}": r["gbps"] for fmt, r in per_format.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="freetoken bench bw", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--gib", type=float, default=8.0, help="host bank size to read from")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-save", action="store_true")
    ap.add_argument(
        "--formats",
        default=",".join(quant.FORMATS),
        help="block formats whose CPU kernel to measure against BF16 (comma-separated; '' none)",
    )
    ap.add_argument(
        "--threads",
        default="",
        help="thread counts to measure each kernel at besides the default (comma-separated)",
    )
    ap.add_argument(
        "--prefetch-bytes",
        default="",
        help="bytes ahead the packed formats' int8 kernels prefetch, each measured in turn at "
        "--threads (comma-separated; 0: none; the kernel's default is 4096)",
    )
    ap.add_argument(
        "--isa",
        choices=cpu_kernel.TIERS,
        help="hold the CPU kernels to this instruction set (e.g. avx2: a desktop CPU without "
        "AVX-512) where they are called directly; nothing is saved as this machine's profile",
    )
    args = ap.parse_args(argv)
    from freetoken import config

    try:
        threads = [int(n) for n in args.threads.split(",") if n]
        prefetch = [int(n) for n in args.prefetch_bytes.split(",") if n]
    except ValueError:
        ap.error("--threads and --prefetch-bytes take whole numbers")
    if any(n < 1 for n in threads) or any(n < 0 for n in prefetch):
        ap.error("--threads counts are at least 1, --prefetch-bytes at least 0")
    formats = [f for f in args.formats.split(",") if f]
    for fmt in formats:
        if fmt not in quant.FORMATS:
            ap.error(f"unknown format {fmt!r} (one of {', '.join(quant.FORMATS)})")
    ext = cpu_kernel.extension() if args.isa else None
    if args.isa and (ext is None or cpu_kernel.TIERS.index(args.isa) > ext.cpu_tier()):
        ap.error(f"--isa {args.isa}: this machine's CPU kernel is {cpu_kernel.tier()}")
    r = run(args.seconds, args.gib, formats, threads, prefetch, args.isa)
    head = common.header("bw")
    if not args.no_save and not args.isa:
        r["profile"] = str(profile.save(config.current().cache_dir, {**r, "date": head["date"]}))
    if args.json:
        print(json.dumps({**head, **r}))
        return
    common.emit(table_rows(r), [("path", "path"), ("gbps", "GB/s"), ("note", "")], False, head)


def table_rows(r: dict) -> list[dict]:
    """The printed table: each path's GB/s, with what it is against."""
    rows = [
        {"path": "CPU expert kernel (B_H)", "gbps": r["cpu_expert_gbps"], "note": r["cpu_kernel"]},
        {
            "path": "plain torch CPU experts",
            "gbps": r["torch_cpu_expert_gbps"],
            "note": f"kernel is {r['cpu_expert_gbps'] / r['torch_cpu_expert_gbps']:.2f}x",
        },
        {
            "path": "DRAM read (torch sum)",
            "gbps": r["dram_read_gbps"],
            "note": f"kernel reaches {r['cpu_expert_gbps'] / r['dram_read_gbps']:.0%}",
        },
    ]
    if "lane" in r:
        rows += lanebw.lane_rows(r["lane"], r["cpu_expert_gbps"])
    if "pcie_gbps" in r:
        rows += [
            {"path": "PCIe expert gather (B_P)", "gbps": r["pcie_gbps"]},
            {"path": "B_P while the CPU runs", "gbps": r["pcie_concurrent_gbps"]},
            {
                "path": "B_H while PCIe runs",
                "gbps": r["cpu_concurrent_gbps"],
                "note": f"sum {r['pcie_concurrent_gbps'] + r['cpu_concurrent_gbps']:.1f} GB/s "
                "together",
            },
            *fetchbw.rows(r.get("fetch") or {}, r["pcie_gbps"], r.get("fetch_idle_us")),
        ]
    for fmt, f in r["formats"].items():
        # the packed formats' goal is a fraction of DRAM read (Q4_K: 0.8), so it is printed
        note = f"{f['gbps'] / r['dram_read_gbps']:.0%} of DRAM read, "
        note += f"{f['experts_per_s']:.0f} experts/s, {f['vs_bf16']:.2f}x BF16's; "
        note += f"fp32 activations {f['exact_gbps']:.1f} GB/s; "
        note += f"{f['hot_gbps']:.1f} GB/s on 8 experts in cache"
        rows.append({"path": f"CPU expert kernel, {fmt}", "gbps": f["gbps"], "note": note})
        if "lane_split_gbps" in f:  # a split's routes through the lane, against the kernel's
            lane, called = f["lane_split_gbps"], f["cpu_split_gbps"]
            rows.append(
                {
                    "path": f"CPU lane, {fmt}, {lanebw.SPLIT_ROUTES} routes a request",
                    "gbps": lane,
                    "note": f"{lane / called:.2f}x the kernel called ({called:.1f})",
                }
            )
    return rows + thread_rows(r)


def thread_rows(r: dict) -> list[dict]:
    """Each kernel at each thread count, against DRAM read and against its own one-thread
    figure (linear scaling would be the count itself)."""
    kernels = [("BF16", r["by_threads"])]
    kernels += [(fmt, f["by_threads"]) for fmt, f in r["formats"].items()]
    rows = []
    for fmt, f in r["formats"].items():
        for ahead, by in (f.get("by_prefetch") or {}).items():
            for n, gbps in by.items():
                path = f"CPU expert kernel, {fmt}, {n} threads, prefetch {ahead} bytes ahead"
                rows.append(
                    {
                        "path": path,
                        "gbps": gbps,
                        "note": f"{f['gbps']:.1f} at the default threads and distance",
                    }
                )
    for name, by in kernels:
        one = by.get(1)
        for n, gbps in by.items():
            note = f"{gbps / r['dram_read_gbps']:.0%} of DRAM read"
            if one:
                note += f", {gbps / one:.1f}x one thread's"
            rows.append(
                {"path": f"CPU expert kernel, {name}, {n} threads", "gbps": gbps, "note": note}
            )
    return rows


if __name__ == "__main__":
    main()
