"""`freetoken bench decode`: bs=1 decode tok/s per expert policy and VRAM budget, against the bound

    T >= T_dense + (misses per token) * S / (B_P + B_H)

T_dense is the measured step time with every expert resident; S is one expert's bytes;
B_P and B_H are measured in the same run (`bench bw`'s paths). Policies are measured
alternately in one run on one machine. Caps emulate consumer GPUs: the whole engine
(weights, KV cache, expert slots) must fit in the budget.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from freetoken import config, quant
from freetoken.bench import common, routing, synthmodel
from freetoken.bench.stepper import PROMPT, Bench, measure_bandwidths, placement, profile_steps
from freetoken.layers import fused
from freetoken.models.hub import num_experts
from freetoken.moe.dispatch import Split
from freetoken.moe.policy import POLICIES
from freetoken.moe.tuning import EXPLORE_AFTER

# the variants each leave out or add one piece of the runner's path (bench/stepper.py)
POLICIES_HELP = (
    "comma-separated; NAME:host keeps the cache's books on the host, "
    "adaptive:nolane serves CPU routes without the CPU lane (which adaptive uses on GPUs), "
    "NAME:ahead fetches the next layer's experts ahead on the routing's own (always right) guesses"
)


def _arguments() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="freetoken bench decode", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(synthmodel.SHAPES))
    ap.add_argument(
        "--layers", type=int, default=0, help="the shape cut to this many layers (as bench serve)"
    )
    ap.add_argument(
        "--caps",
        default="8,24,32",
        help="VRAM budgets in GiB (0: no cache, every expert on the CPU)",
    )
    ap.add_argument(
        "--policies",
        default="lru-pcie,cpu-misses,static-layers,adaptive",
        help=POLICIES_HELP,
    )
    ap.add_argument("--routing", default="random-tokens,trace")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=16)
    ap.add_argument(
        "--settle",
        type=int,
        default=144,
        help="steps run after installing adaptive, unmeasured: its locality check judges the "
        f"routing meanwhile (its placement visits begin only after {EXPLORE_AFTER} decode steps)",
    )
    ap.add_argument(
        "--settle-fixed",
        type=int,
        default=64,
        help="steps run after installing a fixed policy, unmeasured: enough to cycle the cache",
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bw-seconds", type=float, default=2.0)
    ap.add_argument(
        "--fractions",
        action="store_true",
        help="read --caps below 1 as fractions of all experts instead of GiB",
    )
    ap.add_argument(
        "--profile", action="store_true", help="print a torch profile of resident decode steps"
    )
    ap.add_argument(
        "--no-graphs", action="store_true", help="launch every kernel from Python (no CUDA graphs)"
    )
    ap.add_argument(
        "--eager",
        action="store_true",
        help="also time resident steps launched from Python, against the CUDA graphs",
    )
    ap.add_argument(
        "--quant",
        help="experts in a block format (q4_k, mxfp4, …) or laid out as create --quantize would "
        "(q4_K_M, q8_0); random blocks",
    )
    ap.add_argument("--json", action="store_true")
    return ap


COLUMNS = [
    ("routing", "routing"),
    ("cap", "GiB"),
    ("policy", "policy"),
    ("slots", "slots"),
    ("tok_s", "tok/s"),
    ("spread", "±"),
    ("host_ms_per_token", "host ms"),
    ("sync_ms_per_token", "sync ms"),
    ("bound_tok_s", "bound"),
    ("ratio_to_bound", "/bound"),
    ("ratio_concurrent_bound", "/bound(conc)"),
    ("hit_rate", "hit"),
    ("misses_per_token", "miss/tok"),
    ("miss_gbps", "miss GB/s"),
    ("q_share", "q/m"),
    ("vs_best_fixed", "/best fixed"),
]


def main(argv: list[str] | None = None) -> None:
    ap = _arguments()
    args = ap.parse_args(argv)
    for p in args.policies.split(","):  # before the model is built: a typo costs nothing
        name, _, variant = p.partition(":")
        if name not in POLICIES or variant not in ("", "host", "lane", "nolane", "ahead"):
            ap.error(
                f"unknown policy {p!r}: one of {', '.join(POLICIES)}, "
                "optionally :host, :lane, :nolane or :ahead"
            )
    if args.quant and args.quant not in (*quant.FORMATS, *quant.QUANTIZE_TYPES):
        ap.error(f"unknown --quant {args.quant!r}")
    cuda = torch.cuda.is_available()
    if not cuda and not args.model.startswith("tiny"):
        raise SystemExit("bench decode needs a CUDA device for full-size models")
    dev = torch.device("cuda" if cuda else "cpu")
    fused.ENABLED = config.current().fused_kernels  # as the runner sets it
    head = common.header("decode")
    t0 = time.perf_counter()
    ctx = PROMPT + max(args.warmup + args.tokens, args.settle + 4) + 32
    bench = Bench(args.model, dev, ctx, args.fractions, not args.no_graphs, args.quant, args.layers)
    print(
        f"model {args.model} built in {time.perf_counter() - t0:.1f} s; "
        f"experts {bench.host.total_bytes / 2**30:.1f} GiB in host RAM"
        f"{' (' + args.quant + ')' if args.quant else ''}, "
        f"S = {bench.host.expert_bytes / 1e6:.2f} MB"
    )
    b_p, b_h, p_c, h_c = measure_bandwidths(args.bw_seconds, cuda, bench.host.main_format)
    print(f"B_P {b_p:.1f} GB/s, B_H {b_h:.1f} GB/s alone; {p_c:.1f} + {h_c:.1f} GB/s together")
    rows = []
    for mode in args.routing.split(","):
        rows += run_mode(bench, args, mode, (b_p, b_h, p_c, h_c), head)
    common.emit(rows, COLUMNS, False, head)


def run_mode(
    bench: Bench, args, mode: str, bws: tuple[float, float, float, float], head: dict
) -> list[dict]:
    b_p, b_h, p_c, h_c = bws
    S = bench.host.expert_bytes
    if mode in ("trace", "uniform"):
        c = bench.sm.config
        kw = {} if mode == "trace" else {"reuse": 0.0, "zipf": 0.0}
        tr = routing.Trace(c["num_hidden_layers"], num_experts(c), c["num_experts_per_tok"], **kw)
        bench.routes = routing.install_trace(
            bench.sm.model, tr, c["num_hidden_layers"], bench.sm.device
        )
        print(f"{mode} routing parameters: {tr.params()}")
    bench.install("resident", None, Split.from_bandwidths(S, max(b_p, 1e-3) * 1e9, b_h * 1e9))
    t_dense, rows = resident_rows(bench, args, mode)
    if args.profile:
        profile_steps(bench, mode, "resident")
    for i, cap in enumerate(float(c) for c in args.caps.split(",")):
        results: dict[str, list[tuple[float, dict]]] = {}
        slots: dict[str, int] = {}
        seen: dict[str, list[dict]] = {}  # where each policy ended up, repeat by repeat
        for r in range(args.repeats):
            for policy in args.policies.split(","):  # alternate policies within each repeat
                bench.install(
                    policy, cap, Split.from_bandwidths(S, max(b_p, 1e-3) * 1e9, b_h * 1e9)
                )
                # settle the cache, and let adaptive measure its shares and placements
                settle = args.settle if policy.startswith("adaptive") else args.settle_fixed
                bench.decode(mode, settle, 4, 100 + r)
                results.setdefault(policy, []).append(
                    bench.decode(mode, args.tokens, args.warmup, r)
                )
                seen.setdefault(policy, []).append(placement(bench.backend))
                # a run cut short by a time limit still leaves each repeat's figure
                print(
                    f"  {mode} {cap:g} GiB {policy} repeat {r + 1}: "
                    f"{1 / results[policy][-1][0]:.1f} tok/s "
                    f"{seen[policy][-1]}",
                    file=sys.stderr,
                    flush=True,
                )
                slots[policy] = bench.backend.capacity
                if args.profile and i == 0 and r == 0:
                    profile_steps(bench, mode, f"{policy} at {cap:g} GiB")
        # a row's placement is that of the repeat its counters come from
        done = [
            {**row, **seen[row["policy"]][row["median_repeat"] - 1]}
            for row in summarize(mode, cap, results, t_dense, S, bws, slots, bench)
        ]
        for r in done:  # as soon as measured: a run cut short still leaves its figures
            print(json.dumps({**head, **r}), flush=True)
        rows += done
    return rows


def resident_rows(bench: Bench, args, mode: str) -> tuple[float, list[dict]]:
    """T_dense (every expert resident, decode as served), and on a GPU the same steps with
    the torch code instead of the fused kernels (norms, router, decode attention) and, with
    --eager, without CUDA graphs."""

    def timed() -> tuple[float, dict]:
        bench.decode(mode, 8, 4, 0)
        runs = [bench.decode(mode, args.tokens, args.warmup, r) for r in range(args.repeats)]
        return statistics.median(t for t, _ in runs), runs[0][1]

    t_dense, d = timed()
    n = max(d["layers"] / len(bench.host.layers), 1)
    rows = [
        {
            "routing": mode,
            "cap": "all",
            "policy": "resident",
            "tok_s": 1 / t_dense,
            "bound_tok_s": 1 / t_dense,
            "ratio_to_bound": 1.0,
            "hit_rate": 1.0,
            "misses_per_token": 0.0,
            "t_dense_ms": t_dense * 1e3,
            "sync_ms_per_token": d["sync_s"] / n * 1e3,
            "host_ms_per_token": d["host_s"] / n * 1e3,
        }
    ]
    if bench.sm.device.type == "cuda" and fused.ENABLED:
        rows.append(_torch_code_row(bench, mode, t_dense, lambda: timed()[0]))
    if args.eager and bench.graphs is not None:
        rows.append(_eager_row(bench, mode, t_dense, lambda: timed()[0]))
    return t_dense, rows


def _torch_code_row(bench: Bench, mode: str, t_dense: float, timed) -> dict:
    """The resident steps with the torch code for norms, router and attention."""
    if bench.graphs is not None:
        bench.graphs.reset()  # the captured steps hold the fused kernels
    try:
        with fused.disabled():
            t_torch = timed()
    finally:
        if bench.graphs is not None:
            bench.graphs.reset()
    print(
        f"{mode}: resident {1 / t_dense:.1f} tok/s with the fused kernels, "
        f"{1 / t_torch:.1f} with torch's "
        f"code for norms, router and attention ({t_torch / t_dense:.2f}x)",
        flush=True,
    )
    return {
        "routing": mode,
        "cap": "all",
        "policy": "resident, torch code",
        "tok_s": 1 / t_torch,
        "t_dense_ms": t_torch * 1e3,
        "fused_kernels_speedup": t_torch / t_dense,
    }


def _eager_row(bench: Bench, mode: str, t_dense: float, timed) -> dict:
    """The same resident steps, every kernel launched from Python."""
    graphs, bench.graphs = bench.graphs, None
    try:
        t_eager = timed()
    finally:
        bench.graphs = graphs
    print(
        f"{mode}: resident {1 / t_dense:.1f} tok/s with CUDA graphs, {1 / t_eager:.1f} without "
        f"({t_eager / t_dense:.2f}x)",
        flush=True,
    )
    return {
        "routing": mode,
        "cap": "all",
        "policy": "resident, no graphs",
        "tok_s": 1 / t_eager,
        "t_dense_ms": t_eager * 1e3,
        "graphs_speedup": t_eager / t_dense,
    }


def summarize(mode, cap, results, t_dense, S, bws, slots, bench) -> list[dict]:
    b_p, b_h, p_c, h_c = bws
    rows = []
    for policy, runs in results.items():
        times = sorted(t for t, _ in runs)
        # the counters of the run whose time is the median: a row's misses and bound are its own
        median = sorted(range(len(runs)), key=lambda i: runs[i][0])[len(runs) // 2]
        t, d = runs[median]
        tokens_seen = d["layers"] / max(1, len(bench.host.layers))
        miss = d["m"] / max(tokens_seen, 1)
        if cap == 0:  # no cache: the CPU reads every routed expert, PCIe moves none
            b_p = p_c = 0.0
            h_c = b_h
        bound = t_dense + miss * S / ((b_p + b_h) * 1e9)
        bound_c = t_dense + miss * S / ((p_c + h_c) * 1e9)
        k = bench.sm.config["num_experts_per_tok"] * len(bench.host.layers)
        rows.append(
            {
                "routing": mode,
                "cap": cap,
                "policy": policy,
                "tok_s": 1 / t,
                "median_repeat": median + 1,
                "spread": (1 / times[0] - 1 / times[-1]) if len(times) > 1 else 0.0,
                "bound_tok_s": 1 / bound,
                "ratio_to_bound": bound / t,
                "ratio_concurrent_bound": bound_c / t,
                "hit_rate": 1 - miss / k,
                "misses_per_token": miss,
                "q_share": d["q"] / max(d["m"], 1),
                "miss_gbps": miss * S / t / 1e9,  # expert bytes read from the host a second
                "vram_budget_gib": cap,
                "slots": slots[policy],
                "b_p_gbps": b_p,
                "b_h_gbps": b_h,
                "t_dense_ms": t_dense * 1e3,
                "sync_ms_per_token": d["sync_s"] / tokens_seen * 1e3,
                "host_ms_per_token": d["host_s"] / tokens_seen * 1e3,
                "cpu_wait_ms_per_token": d["cpu_wait_s"] / tokens_seen * 1e3,
            }
        )
    fixed = [r["tok_s"] for r in rows if r["policy"].split(":")[0] in ("lru-pcie", "cpu-misses")]
    for r in rows:
        r["vs_best_fixed"] = r["tok_s"] / max(fixed) if fixed else None
    return rows


if __name__ == "__main__":
    main()
