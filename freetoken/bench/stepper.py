"""Decode steps of a random-weight model in memory, as the runner steps it: the shared
machinery of `bench decode`, `bench prefill`, `bench resize` and `bench gpus`.

`Bench` builds a named shape (models/shapes.py), places its experts behind any policy and
cache size, and times decode steps (replayed from CUDA graphs where the runner would) under
a chosen routing mode.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

import numpy as np
import torch

from freetoken.bench import bw, packed, routing, synthmodel
from freetoken.layers.context import SeqSpan, StepContext, step_context
from freetoken.moe import setup
from freetoken.moe.backend import ExpertBackend, ExpertsOps, routers_of
from freetoken.moe.banks import HostBanks
from freetoken.moe.budget import ACTIVATION_RESERVE
from freetoken.moe.cache import ExpertCache
from freetoken.moe.dispatch import Split
from freetoken.moe.offload import OffloadExperts
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
        quant: str | None = None,
        layers: int = 0,
    ):
        sm = synthmodel.build(name, device, quant=quant, layers=layers)
        spec = setup.expert_spec(sm.model)
        host = HostBanks(sm.banks, sm.dtype, device.type == "cuda", spec, sm.formats)
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
        the lane even on a CPU: each measures what the piece it leaves out brings.
        "NAME:ahead" fetches the next layer's guessed experts ahead (moe/lookahead.py); under
        trace or uniform routing the routers read the table, so the guesses are always right:
        the ceiling of what guessing brings, not what a model's routers achieve."""
        policy, _, books = policy.partition(":")
        if self.backend is not None:
            self.backend.close()
        self.backend = None
        if self.graphs is not None:
            self.graphs.reset()  # captured steps hold the old backend and its slot pool
        self._ops.route_through(None)
        gc.collect()
        c, S = self.sm.config, self.host.expert_bytes
        # the cache indexes layers by number; only the MoE layers hold experts
        L, E = c["num_hidden_layers"], self.host.num_experts
        every = len(self.host.layers) * E
        if cap_gib is None:
            slots = every
        elif cap_gib < 1.0 and self.fractions:
            slots = int(cap_gib * every)  # a fraction of all experts, not GiB
        else:
            _sync(self.sm.device, empty=True)
            used = torch.cuda.memory_allocated() if self.sm.device.type == "cuda" else 0
            room = int(cap_gib * 2**30) - used - ACTIVATION_RESERVE
            slots = int(min(max(room // S, 0), every))
        # a cap of 0: no cache, every expert on the CPU (llama.cpp's -ncmoe over all layers)
        cache = (
            ExpertCache(L, E, slots, self.host.rows, self.host.dtypes, self.sm.device)
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
            cpu_lane=books == "lane" or (books in ("", "ahead") and self.sm.device.type == "cuda"),
            lookahead=books == "ahead",
        )
        self.backend.use_routers(routers_of(self.sm.model))
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


def measure_bandwidths(
    seconds: float, cuda: bool, fmt: str = ""
) -> tuple[float, float, float, float]:
    """(B_P, B_H, B_P together, B_H together) in GB/s, measured now on `bench bw`'s paths;
    B_H on banks of block format `fmt` where given (bytes are bytes over PCIe)."""
    banks = bw.Banks(2, pin=cuda)
    cpu_banks = packed.PackedBanks.make(fmt, bw.E, bw.H, bw.I, 2) if fmt else banks
    bw.measure_cpu(cpu_banks, 0.3)
    b_h = bw.measure_cpu(cpu_banks, seconds)
    if not cuda:
        return 0.0, b_h, 0.0, b_h
    b_p = bw.measure_pcie(banks, seconds)
    p_c, h_c = bw.concurrent(banks, seconds)
    if fmt:  # B_H beside PCIe, scaled from BF16's to the format's
        h_c *= b_h / bw.measure_cpu(banks, seconds)
    return b_p, b_h, p_c, h_c


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
    table = prof.key_averages().table
    print(table(sort_by="self_cpu_time_total", row_limit=18), flush=True)
    if ProfilerActivity.CUDA in acts:  # the kernels a step runs, captured ones included
        print(f"--- the same steps' kernels by device time, {label}")
        print(table(sort_by="self_device_time_total", row_limit=30), flush=True)
