"""`freetoken bench decode`: bs=1 decode tok/s per expert policy and VRAM budget, against the bound

    T >= T_dense + (misses per token) * S / (B_P + B_H)

T_dense is the measured step time with every expert resident; S is one expert's bytes;
B_P and B_H are measured in the same run (`bench bw`'s paths). Policies are measured
alternately in one run on one machine. Caps emulate consumer GPUs: the whole engine
(weights, KV cache, expert slots) must fit in the budget.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

from freetoken import config
from freetoken.bench import bw, common, routing, synthmodel
from freetoken.layers import fused
from freetoken.layers.context import SeqSpan, StepContext, step_context
from freetoken.moe import setup
from freetoken.moe.backend import ExpertBackend, ExpertsOps
from freetoken.moe.banks import HostBanks
from freetoken.moe.cache import ExpertCache
from freetoken.moe.dispatch import Split
from freetoken.moe.offload import POLICIES, OffloadExperts
from freetoken.moe.setup import ACTIVATION_RESERVE
from freetoken.runtime.graphs import DecodeGraphs
from freetoken.runtime.kv_cache import KVCache

PROMPT = 16


class Bench:
    def __init__(
        self,
        name: str,
        device: torch.device,
        ctx_tokens: int,
        fractions: bool = False,
        graphs: bool = True,
    ):
        sm = synthmodel.build(name, device)
        host = HostBanks(
            sm.banks, sm.dtype, pin=device.type == "cuda", spec=setup.expert_spec(sm.model)
        )
        sm.banks = {}
        self._setup(sm, host, ctx_tokens, fractions, graphs)

    @classmethod
    def around(cls, sm: synthmodel.SynthModel, ctx_tokens: int) -> Bench:
        """A bench over a model whose experts op the caller places (after this allocates the
        KV cache, as a runner does), then sets as `backend`."""
        self = cls.__new__(cls)
        self._setup(sm, None, ctx_tokens, False, True)
        return self

    def _setup(
        self,
        sm: synthmodel.SynthModel,
        host: HostBanks | None,
        ctx_tokens: int,
        fractions: bool,
        graphs: bool,
    ) -> None:
        self.fractions = fractions
        self.sm, self.host = sm, host
        device = sm.device
        self.kv = KVCache(sm.model.kv_layout(), -(-ctx_tokens // 16), 16, sm.dtype, device)
        self.backend: ExpertBackend | None = None
        self._ops = ExpertsOps(sm.model)
        self.routes: routing.RouteTable | None = None  # set by the trace and uniform modes
        # decode steps run as the server runs them: replayed from CUDA graphs where possible
        self.graphs = (
            DecodeGraphs(sm.model, self.kv, device, ctx_tokens, capture=graphs, min_ctx=ctx_tokens)
            if graphs and device.type == "cuda"
            else None
        )

    def counters(self) -> dict:
        """This process's expert counters (rank 0's own when the experts are spread over GPUs)."""
        return self.backend.counters()

    def install(self, policy: str, cap_gib: float | None, split: Split) -> OffloadExperts:
        """`policy` as the runner has it (on a GPU, adaptive's single-token CPU routes go
        through the CPU lane); "NAME:host" keeps the cache's books on the host (no device-kept
        books), "adaptive:nolane" serves CPU routes from the host, and "adaptive:lane" through
        the lane even on a CPU: each measures what the piece it leaves out brings."""
        policy, _, books = policy.partition(":")
        if self.backend is not None:
            self.backend.close()
        self.backend = None
        if self.graphs is not None:
            self.graphs.reset()  # captured steps hold the old backend and its slot pool
        self._ops.route_through(None)
        gc.collect()
        c, S = self.sm.config, self.host.expert_bytes
        L, E = c["num_hidden_layers"], c["num_experts"]
        if cap_gib is None:
            slots = L * E
        elif cap_gib < 1.0 and self.fractions:
            slots = int(cap_gib * L * E)  # a fraction of all experts, not GiB
        else:
            _sync(self.sm.device, empty=True)
            used = torch.cuda.memory_allocated() if self.sm.device.type == "cuda" else 0
            room = int(cap_gib * 2**30) - used - ACTIVATION_RESERVE
            slots = int(min(max(room // S, 0), L * E))
        # a cap of 0: no cache, every expert on the CPU (llama.cpp's -ncmoe over all layers)
        cache = (
            ExpertCache(L, E, slots, self.host.rows, self.sm.dtype, self.sm.device)
            if cap_gib != 0
            else None
        )
        self.backend = OffloadExperts(
            self.host,
            cache,
            policy,
            split,
            self.sm.device,
            device_lru=self.sm.device.type == "cuda" and books != "host",
            cpu_lane=books == "lane" or (books == "" and self.sm.device.type == "cuda"),
        )
        self._ops.route_through(self.backend)
        self.backend.warm()
        return self.backend

    @torch.inference_mode()
    def decode(
        self,
        mode: str,
        tokens: int,
        warmup: int,
        seed: int,
        at_start: Callable[[], None] | None = None,
    ) -> tuple[float, dict]:
        """Seconds per token over `tokens` steps after `warmup`, and the counters' change;
        `at_start` runs just before the timed steps."""
        kv, dev = self.kv, self.sm.device
        rng = np.random.default_rng(seed)
        V = self.sm.config["vocab_size"]
        pages = kv.pool.alloc(kv.pages_for(PROMPT + warmup + tokens + 1))
        try:
            ids = rng.integers(V, size=PROMPT).tolist()
            nxt = self._step(ids, 0, pages)
            t0, before = 0.0, None
            for i in range(warmup + tokens):
                if i == warmup:
                    _sync(dev)
                    if at_start is not None:
                        at_start()
                    before = (
                        self.counters()
                    )  # reading them may wait for the device: before the clock
                    t0 = time.perf_counter()
                tok = int(rng.integers(V)) if mode == "random-tokens" else nxt
                nxt = self._step([tok], PROMPT + i, pages)
            _sync(dev)
            dt = time.perf_counter() - t0
        finally:
            kv.pool.release(pages)
        now = self.counters()
        delta = {k: now[k] - before[k] for k in before}
        return dt / tokens, delta

    def _step(self, ids: list[int], start: int, pages: list[int]) -> int:
        n = len(ids)
        self.backend.between_steps(n)  # as the engine does before every step
        if self.graphs is not None and n == 1:
            logits = self.graphs.run(ids, [start], [pages])
        else:
            logits = self._eager(ids, start, pages)
        if self.routes is not None:
            self.routes.advance(n)
        self.backend.wait_step()  # as the engine waits for a step
        return int(logits[-1].argmax())

    def _eager(self, ids: list[int], start: int, pages: list[int]) -> torch.Tensor:
        n = len(ids)
        ctx_slots = self.kv.slots_of(pages, 0, start + n, self.sm.device)
        positions = torch.arange(start, start + n, device=self.sm.device)
        ctx = StepContext(
            positions,
            ctx_slots[start:],
            [SeqSpan(0, n, start + n, ctx_slots)],
            self.kv,
            torch.tensor([n - 1], device=self.sm.device),
        )
        with step_context(ctx):
            h = self.sm.model(torch.tensor(ids, device=self.sm.device), positions)
            return self.sm.model.logits(h[-1:])


def _sync(device: torch.device, empty: bool = False) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
        if empty:
            torch.cuda.empty_cache()


def measure_bandwidths(seconds: float, cuda: bool) -> tuple[float, float, float, float]:
    """(B_P, B_H, B_P together, B_H together) in GB/s, measured now on `bench bw`'s paths."""
    banks = bw.Banks(2, pin=cuda)
    bw.measure_cpu(banks, 0.3)
    b_h = bw.measure_cpu(banks, seconds)
    if not cuda:
        return 0.0, b_h, 0.0, b_h
    b_p = bw.measure_pcie(banks, seconds)
    p_c, h_c = bw.concurrent(banks, seconds)
    return b_p, b_h, p_c, h_c


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="freetoken bench decode", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(synthmodel.SHAPES))
    ap.add_argument(
        "--caps",
        default="8,24,32",
        help="VRAM budgets in GiB (0: no cache, every expert on the CPU)",
    )
    ap.add_argument(
        "--policies",
        default="lru-pcie,cpu-misses,static-layers,adaptive",
        help="comma-separated; NAME:host keeps the cache's books on the host, "
        "adaptive:nolane serves CPU routes without the CPU lane (which adaptive uses on GPUs)",
    )
    ap.add_argument("--routing", default="random-tokens,trace")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=16)
    ap.add_argument(
        "--settle",
        type=int,
        default=144,
        help="steps run after installing adaptive, unmeasured: it measures its placements "
        "meanwhile "
        "(4 modes, each visited twice for 8 settling and 6 timed steps)",
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
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    for p in args.policies.split(","):  # before the model is built: a typo costs nothing
        name, _, variant = p.partition(":")
        if name not in POLICIES or variant not in ("", "host", "lane", "nolane"):
            ap.error(
                f"unknown policy {p!r}: one of {', '.join(POLICIES)}, "
                "optionally :host, :lane or :nolane"
            )
    cuda = torch.cuda.is_available()
    if not cuda and args.model != "tiny":
        raise SystemExit("bench decode needs a CUDA device for full-size models")
    dev = torch.device("cuda" if cuda else "cpu")
    fused.ENABLED = config.current().fused_kernels  # as the runner sets it
    head = common.header("decode")
    t0 = time.perf_counter()
    ctx = PROMPT + max(args.warmup + args.tokens, args.settle + 4) + 32
    bench = Bench(args.model, dev, ctx, args.fractions, not args.no_graphs)
    print(
        f"model {args.model} built in {time.perf_counter() - t0:.1f} s; "
        f"experts {bench.host.total_bytes / 2**30:.1f} GiB in host RAM, "
        f"S = {bench.host.expert_bytes / 1e6:.2f} MB"
    )
    b_p, b_h, p_c, h_c = measure_bandwidths(args.bw_seconds, cuda)
    print(f"B_P {b_p:.1f} GB/s, B_H {b_h:.1f} GB/s alone; {p_c:.1f} + {h_c:.1f} GB/s together")
    rows = []
    for mode in args.routing.split(","):
        rows += run_mode(bench, args, mode, (b_p, b_h, p_c, h_c), head)
    cols = [
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
    common.emit(rows, cols, False, head)


def run_mode(
    bench: Bench, args, mode: str, bws: tuple[float, float, float, float], head: dict
) -> list[dict]:
    b_p, b_h, p_c, h_c = bws
    S = bench.host.expert_bytes
    if mode in ("trace", "uniform"):
        c = bench.sm.config
        kw = {} if mode == "trace" else {"reuse": 0.0, "zipf": 0.0}
        tr = routing.Trace(c["num_hidden_layers"], c["num_experts"], c["num_experts_per_tok"], **kw)
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
        if bench.graphs is not None:
            bench.graphs.reset()  # the captured steps hold the fused kernels
        try:
            with fused.disabled():
                t_torch = timed()[0]
        finally:
            if bench.graphs is not None:
                bench.graphs.reset()
        rows.append(
            {
                "routing": mode,
                "cap": "all",
                "policy": "resident, torch code",
                "tok_s": 1 / t_torch,
                "t_dense_ms": t_torch * 1e3,
                "fused_kernels_speedup": t_torch / t_dense,
            }
        )
        print(
            f"{mode}: resident {1 / t_dense:.1f} tok/s with the fused kernels, "
            f"{1 / t_torch:.1f} with torch's "
            f"code for norms, router and attention ({t_torch / t_dense:.2f}x)",
            flush=True,
        )
    if (
        args.eager and bench.graphs is not None
    ):  # the same resident steps, every kernel launched from Python
        graphs, bench.graphs = bench.graphs, None
        t_eager = timed()[0]
        bench.graphs = graphs
        rows.append(
            {
                "routing": mode,
                "cap": "all",
                "policy": "resident, no graphs",
                "tok_s": 1 / t_eager,
                "t_dense_ms": t_eager * 1e3,
                "graphs_speedup": t_eager / t_dense,
            }
        )
        print(
            f"{mode}: resident {1 / t_dense:.1f} tok/s with CUDA graphs, {1 / t_eager:.1f} without "
            f"({t_eager / t_dense:.2f}x)",
            flush=True,
        )
    return t_dense, rows


def placement(backend) -> dict:
    """Adaptive's placement and share, and the CPU lane's counts, as the backend ended a run."""
    s = backend.stats()
    share = s["pcie_share"]["share"] if "pcie_share" in s else None  # adaptive's alone
    out = {"placement": str(backend.placement.mode), "share": share}
    if "lane" in s:
        out.update({f"lane_{k}": v for k, v in s["lane"].items()})
    return out


def profile_steps(bench: Bench, mode: str, label: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + (
        [ProfilerActivity.CUDA] if bench.sm.device.type == "cuda" else []
    )
    with profile(activities=acts) as prof:
        bench.decode(mode, 8, 2, 7)
    print(f"--- profile of 8 decode steps, {mode} routing, {label}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18), flush=True)


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
