"""`freetoken bench prefill`: prompt throughput with whole-layer expert streaming.

For each prompt length: time to first token and tok/s with the copy stream overlapping
compute and without (each layer's copy waited for before it computes), against the two
floors: the PCIe bound (every expert of every layer that is not already cached crosses
PCIe once per chunk: fetched·S / B_P) and the compute time (the same prefill with every expert
resident). Ratio = max(PCIe bound, compute) / measured.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from freetoken.bench import bw, common
from freetoken.bench.stepper import Bench, _sync
from freetoken.moe.dispatch import Split

SLOTS_CAP_GIB = 24.0


def prefill_seconds(bench: Bench, length: int, chunk: int, seed: int) -> float:
    """Wall time of a prefill of `length` random tokens in chunks (until the first token)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(bench.sm.config["vocab_size"], size=length).tolist()
    kv = bench.kv
    pages = kv.pool.alloc(kv.pages_for(length + 1))
    try:
        _sync(bench.sm.device)
        t0 = time.perf_counter()
        for start in range(0, length, chunk):
            with torch.inference_mode():
                bench._step(ids[start : start + chunk], start, pages)
        _sync(bench.sm.device)
        return time.perf_counter() - t0
    finally:
        kv.pool.release(pages)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="freetoken bench prefill", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--cap", type=float, default=SLOTS_CAP_GIB, help="VRAM budget in GiB")
    ap.add_argument("--lengths", default="512,2048,8192,16384")
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench prefill measures PCIe streaming and needs a CUDA device")
    lengths = [int(n) for n in args.lengths.split(",")]
    head = common.header("prefill")
    bench = Bench(args.model, torch.device("cuda"), max(lengths) + 64)
    banks = bw.Banks(2, pin=True)
    b_p = bw.measure_pcie(banks, 2.0)
    del banks
    split = Split.from_bandwidths(bench.host.expert_bytes, b_p * 1e9, b_p * 1e9)
    bench.install("resident", None, split)
    prefill_seconds(bench, min(lengths), args.chunk, 0)  # warm-up
    compute = {n: prefill_seconds(bench, n, args.chunk, 1) for n in lengths}
    rows = []
    for overlap in (True, False):
        rows += _streamed(bench, args, lengths, split, compute, b_p, overlap, head)
    common.emit(rows, COLUMNS, False, head)


COLUMNS = [
    ("prompt", "tokens"),
    ("overlap", "overlap"),
    ("ttft_s", "TTFT s"),
    ("tok_s", "tok/s"),
    ("pcie_bound_s", "PCIe s"),
    ("compute_s", "compute s"),
    ("ratio_to_floor", "/floor"),
]


def _streamed(bench, args, lengths, split, compute, b_p, overlap: bool, head: dict) -> list[dict]:
    """Prefill of every length with whole layers streamed, double-buffered or not."""
    S = bench.host.expert_bytes
    L, E = len(bench.host.layers), bench.host.num_experts
    rows = []
    # no reference to the backend kept: the next install must be able to free its slot pool
    streamer = bench.install("adaptive", args.cap, split).streamer
    if streamer is None:
        raise SystemExit(f"a {args.cap} GiB budget cannot hold the two layer buffers")
    streamer.overlap = overlap
    prefill_seconds(bench, min(lengths), args.chunk, 0)
    for n in lengths:
        before = streamer.stats["h2d_experts"]
        t = prefill_seconds(bench, n, args.chunk, 2)
        # experts the cache already held are copied on the device, not over PCIe
        fetched = streamer.stats["h2d_experts"] - before
        pcie = fetched * S / (b_p * 1e9)
        floor = max(pcie, compute[n])
        row = {
            "prompt": n,
            "overlap": overlap,
            "ttft_s": t,
            "tok_s": n / t,
            "pcie_bound_s": pcie,
            "h2d_experts": fetched,
            "all_experts": -(-n // args.chunk) * L * E,
            "compute_s": compute[n],
            "ratio_to_floor": floor / t,
            "vram_budget_gib": args.cap,
            "b_p_gbps": b_p,
            "chunk": args.chunk,
            "model": args.model,
        }
        print(json.dumps({**head, **row}), flush=True)
        rows.append(row)
    return rows


if __name__ == "__main__":
    main()
