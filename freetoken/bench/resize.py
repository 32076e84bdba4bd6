"""`freetoken bench resize`: shrink the expert cache by half and grow it back while decoding.

Reports the stall (the longest step around each resize against the median step), failed
steps, and tok/s right after the grow (a cold cache refilling) against steady state.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from freetoken.bench import common, routing
from freetoken.bench.stepper import PROMPT, Bench, _sync
from freetoken.models.hub import num_experts
from freetoken.moe.dispatch import Split


def run(bench: Bench, steps: int, shrink_at: int, grow_at: int, mode: str) -> dict:
    backend = bench.backend
    full = backend.cache.capacity
    rng = np.random.default_rng(0)
    V = bench.sm.config["vocab_size"]
    pages = bench.kv.pool.alloc(bench.kv.pages_for(PROMPT + steps + 1))
    times, failed, resize_s = [], 0, {}
    try:
        nxt = bench._step(rng.integers(V, size=PROMPT).tolist(), 0, pages)
        for i in range(steps):
            t0 = time.perf_counter()
            if i in (shrink_at, grow_at):
                target = full // 2 if i == shrink_at else full
                r0 = time.perf_counter()
                backend.resize(target)
                resize_s[i] = time.perf_counter() - r0
            try:
                tok = int(rng.integers(V)) if mode == "random-tokens" else nxt
                with torch.inference_mode():
                    nxt = bench._step([tok], PROMPT + i, pages)
            except Exception:  # counted, not hidden: the goal is that none happen
                failed += 1
            _sync(bench.sm.device)
            times.append(time.perf_counter() - t0)
    finally:
        bench.kv.pool.release(pages)
    steady = statistics.median(times[max(0, shrink_at - 32) : shrink_at])
    cold = times[grow_at + 1 : grow_at + 33]
    return {
        "slots_full": full,
        "slots_half": full // 2,
        "steady_step_ms": steady * 1e3,
        "shrink_stall_ms": (times[shrink_at] - steady) * 1e3,
        "grow_stall_ms": (times[grow_at] - steady) * 1e3,
        "shrink_resize_ms": resize_s[shrink_at] * 1e3,
        "grow_resize_ms": resize_s[grow_at] * 1e3,
        "failed_steps": failed,
        "steady_tok_s": 1 / steady,
        "after_grow_tok_s": len(cold) / sum(cold),
        "cold_over_steady": (len(cold) / sum(cold)) * steady,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="freetoken bench resize", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--cap", type=float, default=24.0, help="VRAM budget in GiB")
    ap.add_argument("--routing", default="trace", choices=routing.MODES)
    ap.add_argument("--steps", type=int, default=192)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench resize needs a CUDA device")
    head = common.header("resize")
    bench = Bench(args.model, torch.device("cuda"), PROMPT + args.steps + 32)
    if args.routing in ("trace", "uniform"):
        c = bench.sm.config
        kw = {} if args.routing == "trace" else {"reuse": 0.0, "zipf": 0.0}
        bench.routes = routing.install_trace(
            bench.sm.model,
            routing.Trace(c["num_hidden_layers"], num_experts(c), c["num_experts_per_tok"], **kw),
            c["num_hidden_layers"],
            bench.sm.device,
        )
    S = bench.host.expert_bytes
    bench.install("adaptive", args.cap, Split.from_bandwidths(S, 50e9, 50e9))
    row = {
        "routing": args.routing,
        "vram_budget_gib": args.cap,
        "model": args.model,
        **run(bench, args.steps, args.steps // 3, 2 * args.steps // 3, args.routing),
    }
    print(json.dumps({**head, **row}), flush=True)
    common.emit(
        [row],
        [
            (k, k)
            for k in (
                "slots_full",
                "steady_tok_s",
                "shrink_stall_ms",
                "grow_stall_ms",
                "failed_steps",
                "after_grow_tok_s",
                "cold_over_steady",
            )
        ],
        False,
        head,
    )


if __name__ == "__main__":
    main()
