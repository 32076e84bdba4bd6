"""The CPU lane: CPU experts inside a captured decode step, without a host round trip.

Where a single-token step gives routes to the CPU (a share of a layer's misses, or a
whole CPU layer), the host used to wait for the routing, compute, and send the result
back: the CUDA graph was cut at that layer and each cut cost ~0.25 ms of host work. Here
a kernel writes the layer's activations and CPU routes into pinned memory (only where it
gives the CPU a route), a C++ loop on its own thread (GIL released) computes them as soon
as the sequence number moves, and a kernel later in the same graph waits for its answer
and adds it in (kernels/triton/lane.py, kernels/cpu/lane.cpp). The GPU's own share of the
layer runs in between.

On a machine without CUDA the same mailbox is driven by plain tensor ops, so the loop,
the protocol and the arithmetic are tested everywhere.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref

import torch

from freetoken import config
from freetoken.ftw.hostmem import HostBuffer, torch_dtype
from freetoken.kernels import cpu as cpu_kernel
from freetoken.moe.banks import MATRICES, HostBanks

log = logging.getLogger(__name__)

MAX_TOKENS = 8  # tokens one request can carry: a decode batch's (tuning.DECODE_TOKENS)
MAX_ROUTES = 256  # routes one request can carry: MAX_TOKENS × a top-k of up to 32
WARM_ROUTES = 8  # the warm-up's top-k: the kernels' form is one for every k up to 16
MAX_SPINS = 50_000_000  # GPU polls before it gives up on the lane (seconds, not a hang)
POLL_NAP = 20e-6  # the CPU-only mailbox's wait between polls of `done` (seconds)
SEQ, DONE, ROUTES, STOP, SERVED, FAILED, TIMEOUTS, BUSY_NS = 0, 1, 2, 3, 4, 5, 6, 7
TEAM, JOINED, PASSES = 8, 9, 10  # the team asked for; its members in passes, and passes
CTL = 16  # the control block's int64s (lane.cpp lists them)


class Mailbox:
    """One request's bytes, in one pinned buffer the post kernel writes: the layer's
    position, routes a token, tokens and the first intermediate row the CPU computes
    (int64), routes (int64, token-major, -1 where not the
    CPU's), route weights (fp32), then each token's activations (fp32), up to MAX_TOKENS."""

    HEAD = 4 * 8 + MAX_ROUTES * 8 + MAX_ROUTES * 4

    def __init__(self, hidden: int, device: torch.device, pin: bool = False):
        self.hidden = hidden
        self.raw = _zeros(self.HEAD + MAX_TOKENS * hidden * 4, device, pin)
        self.pos = self.raw[:32].view(torch.int64)  # position, routes a token, tokens, row
        self.ids = self.raw[32 : 32 + MAX_ROUTES * 8].view(torch.int64)
        self.wts = self.raw[32 + MAX_ROUTES * 8 : self.HEAD].view(torch.float32)
        self.x = self.raw[self.HEAD :].view(torch.float32).view(MAX_TOKENS, hidden)
        self.ids.fill_(-1)


def _kernel_banks(banks: HostBanks) -> tuple:
    """The lane kernel's arguments in lane_serve's order: matrices, biases (empty: none), and
    each layer's formats."""
    per_layer = [banks.banks[layer] for layer in banks.layers]
    spec = banks.spec
    return (
        *([b[name] for b in per_layer] for name in ("gate_up", "down")),
        *(
            [b[name] for b in per_layer] if spec.bias else []
            for name in ("gate_up_bias", "down_bias")
        ),
        *([banks.specs[layer].format_code(name) for layer in banks.layers] for name in MATRICES),
    )


def lane_cpus(cores: list[int], threads: int = 0) -> list[int]:
    """The logical CPUs (one a physical core) the lane's team is pinned to: the last
    `threads` of `cores`, or with 0 every one but the first.

    The core left over is for everything else that wakes during a decode step: the runner's
    event loop streaming the last token, the HTTP server and its client, the engine thread
    once the step ends, the CUDA driver's threads. With a worker pinned to every core, each
    of those took a core from a worker mid-request, and every pass of the kernel ends in a
    barrier that waits for its slowest worker: a request took the preempted worker's time
    slice instead of its own work (4-6x the kernel alone, in the server only)."""
    if threads:
        return cores[-threads:]
    return cores[1:] or cores


class CpuLane:
    def __init__(
        self,
        banks: HostBanks,
        device: torch.device,
        threads: int = 0,
        spin_ms: int | None = None,
        give_way: bool = False,
    ):
        """threads: how many pinned workers, one to a physical core (0: lane_cpus' default);
        spin_ms: how long they spin after a request before they nap (None: the setting's);
        give_way: whether the workers run under SCHED_IDLE, so other threads take their
        cores at once (lane.cpp says why)."""
        ext = cpu_kernel.extension()
        if ext is None:
            raise RuntimeError("the CPU lane needs the compiled CPU expert kernel")
        cpus = lane_cpus(cpu_kernel.physical_cpus(), threads)
        self.device, self.cpus, self._ext = device, cpus, ext
        # A request that finds the team napping runs on the threads that woke in time: on the
        # H100 machine one route took 168 us after 5-20 ms without a request and 93 us back to
        # back; spinning 30 ms took it to 109-120 us. A split at 12 layers posts every few steps,
        # and through the server 30 ms held 4 streams at 1,402 tok/s against 1,285 with 2 ms.
        self.spin_us = (config.current().lane_spin_ms if spin_ms is None else spin_ms) * 1000
        self.give_way = give_way
        self.pos = {layer: i for i, layer in enumerate(banks.layers)}
        hidden = banks.spec.hidden
        pin = device.type == "cuda"
        host = torch.device("cpu")
        self.ctl = _zeros(CTL, host, pin, "int64")
        self._team = 0  # the members requests run on (0: all), as last asked
        self.host = Mailbox(hidden, host, pin)
        # the flat tensor holds the registration (a view of it would not): kept beside the view
        self._out_flat = _zeros(MAX_TOKENS * hidden, host, pin, "float32")
        self.out = self._out_flat.view(MAX_TOKENS, hidden)
        # device side: whether this layer posted, and the last sequence number posted
        self.pend = torch.zeros(1, dtype=torch.int64, device=device)
        self.count = torch.zeros(1, dtype=torch.int64, device=device)
        self.polls = torch.zeros(1, dtype=torch.int64, device=device)  # the GPU's polls of `done`
        self.whole = torch.zeros(1, dtype=torch.int32, device=device)  # from row 0: every row
        self._banks = _kernel_banks(banks)
        # what the experts compute, and whether packed banks take int8 activations
        spec = banks.spec
        self._act = (
            spec.activation_code,
            spec.alpha,
            spec.limit,
            cpu_kernel.int8_activations(banks.dtype),
        )
        self._all: dict[int, torch.Tensor] = {}
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Starts the serving loop unless it runs; call before any step that posts."""
        if self._thread is not None and self._thread.is_alive():
            return
        self.ctl[STOP] = 0
        h = self.host
        args = (
            self.ctl,
            h.pos,
            h.ids,
            h.wts,
            h.x,
            self.out,
            *self._banks,
            self.cpus,
            -1,
            *self._act,
            self.spin_us,
            self.give_way,
        )
        self._thread = threading.Thread(
            target=self._ext.lane_serve, args=args, name="ft-cpu-lane", daemon=True
        )
        self._thread.start()
        # stop the loop when the owner goes away: it holds the banks
        weakref.finalize(self, _stop, self.ctl, self._thread)

    def stop(self) -> None:
        _stop(self.ctl, self._thread)
        self._thread = None

    def warm(self, dtype: torch.dtype) -> None:
        """Compiles the post and collect kernels at load with a request that gives the CPU
        nothing (no sequence number moves), so a step that first posts does not (on a fresh
        H200 the first step of a split visit, where they first ran, took 1.27 s)."""
        x = torch.zeros((1, self.host.hidden), dtype=dtype, device=self.device)
        routes = torch.zeros((1, WARM_ROUTES), dtype=torch.int64, device=self.device)
        weights = torch.zeros((1, WARM_ROUTES), dtype=dtype, device=self.device)
        none = torch.zeros(WARM_ROUTES, dtype=torch.bool, device=self.device)
        self.post(next(iter(self.pos)), x, routes, weights, none)
        self.collect(x)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def size_team(self, fraction: float) -> None:
        """Runs requests from now on on `fraction` of the team's members, the loop's thread
        among them (1: every one); the others nap, their cores left to the rest of the host."""
        size = 0 if fraction >= 1 else max(1, round(fraction * len(self.cpus)))
        if size != self._team:  # a write to pinned memory the loop reads: only on a change
            self._team = size
            self.ctl[TEAM] = size

    def stats(self) -> dict:
        """Counts, and per request: routes, the CPU's microseconds, the GPU's polls of `done`
        (a poll is a read across PCIe, about a microsecond); the team asked for, and the
        members that ran a pass of the kernel on average (those that joined it in time)."""
        c, n = self.ctl.tolist(), max(int(self.count), 1)
        per = max(c[SERVED], 1)
        return {
            "served": c[SERVED],
            "failed": c[FAILED],
            "timeouts": c[TIMEOUTS],
            "threads": len(self.cpus),
            "team": c[TEAM] or len(self.cpus),
            "passes": c[PASSES],
            "members_per_pass": c[JOINED] / c[PASSES] if c[PASSES] else None,
            "routes_per_request": c[ROUTES] / per,
            "cpu_us_per_request": c[BUSY_NS] / per / 1e3,
            "polls_per_request": int(self.polls) / n,
        }

    # --- inside a step (capturable on a GPU) ------------------------------------------------
    def serves(self, tokens: int) -> bool:
        """Whether a step of `tokens` tokens can post its routes here."""
        return tokens <= MAX_TOKENS

    def post(
        self,
        layer: int,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        cpu: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
    ) -> None:
        """Posts the routes `ids` [T, k] of T tokens `x` [T, H] that `cpu` [T·k] marks (all
        of them with None) to the lane; `rows` [1] int32: the first intermediate row of each
        the CPU computes (None: every row; the GPU reads the others, moe_gpu.HostRows)."""
        T, k = ids.shape
        ids, weights, x = (
            ids.reshape(-1).contiguous(),
            weights.reshape(-1).contiguous(),
            x.contiguous(),
        )
        assert x.shape[0] == T <= MAX_TOKENS and T * k <= MAX_ROUTES, "too large for the lane"
        cpu = self._everything(T * k) if cpu is None else cpu
        rows = self.whole if rows is None else rows
        if self.device.type == "cuda":
            from freetoken.kernels.triton import block, lane

            h = self.host
            lane.post_kernel[(1,)](
                x,
                ids,
                weights,
                cpu,
                h.x,
                h.ids,
                h.wts,
                h.pos,
                self.ctl,
                self.pend,
                self.count,
                rows,
                self.pos[layer],
                k,
                T,
                H=x.shape[-1],
                BLOCK_H=1024,
                K=max(16, block(T * k)),
                FENCE=True,
            )
            return
        h = self.host
        h.x[:T].copy_(x)
        h.ids[: T * k] = torch.where(cpu, ids, -1)
        h.wts[: T * k] = weights.float()
        h.pos[:] = torch.tensor([self.pos[layer], k, T, int(rows)])
        self.pend.fill_(int(cpu.any()))
        if int(self.pend):
            self.count += 1
            self.ctl[SEQ] = int(self.count)  # last: the loop reads the mailbox once this moves

    def collect(self, y: torch.Tensor) -> torch.Tensor:
        """y [T, H] plus the CPU's output for the last post (y itself where nothing was posted)."""
        if self.device.type == "cuda":
            from freetoken.kernels.triton import lane

            out = torch.empty_like(y)
            lane.collect_kernel[(1,)](
                y,
                out,
                self.out,
                self.ctl,
                self.pend,
                self.count,
                self.polls,
                MAX_SPINS,
                y.shape[0],
                H=y.shape[-1],
                BLOCK_H=1024,
                num_warps=1,
            )
            return out
        if not int(self.pend):
            return y
        seq, t0 = int(self.count), time.perf_counter()
        while int(self.ctl[DONE]) < seq:
            if time.perf_counter() - t0 > 30 or self._thread is None or not self._thread.is_alive():
                raise RuntimeError("the CPU lane did not answer")
            self.polls += 1
            # asleep, as the engine waits for a GPU step: a yielding loop here would be one
            # more thread competing with the team for its cores
            time.sleep(POLL_NAP)
        return y + self.out[: y.shape[0]].to(y.dtype)

    def _everything(self, k: int) -> torch.Tensor:
        if k not in self._all:
            self._all[k] = torch.ones(k, dtype=torch.bool, device=self.device)
        return self._all[k]


def _zeros(n: int, device: torch.device, pin: bool, dtype: str = "uint8") -> torch.Tensor:
    """n zeroed elements; with `pin`, host bytes registered with CUDA (so kernels address them),
    outside torch's pinned allocator: copies into its blocks record events, which a captured
    step must not. The tensor returned keeps the registration alive, a view of it does not:
    the buffer unregisters itself when it is freed."""
    if not pin:
        return torch.zeros(n, dtype=torch_dtype(dtype), device=device)
    nbytes = n * torch_dtype(dtype).itemsize
    buf = HostBuffer(nbytes)
    buf.pin()
    t = buf.tensor(dtype, [n], nbytes)
    t.zero_()
    return t


def _stop(ctl: torch.Tensor, thread: threading.Thread | None) -> None:
    ctl[STOP] = 1
    if thread is not None and thread is not threading.current_thread():
        thread.join(timeout=5)


def capturing(device: torch.device) -> bool:
    """Inside a CUDA graph capture an op's Python runs once for every later replay."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def make(banks: HostBanks, device: torch.device) -> CpuLane | None:
    """A lane for `banks` on every physical core but one (lane_cpus), or None (logged) where
    the CPU kernel cannot be built. The thread that launches a step waits for it asleep (the
    backend's `wait_step`), not on a core."""
    try:
        cfg = config.current()
        return CpuLane(
            banks,
            device,
            threads=cfg.cpu_threads,
            spin_ms=cfg.lane_spin_ms,
            give_way=cfg.lane_give_way,
        )
    except RuntimeError as e:
        log.warning("no CPU lane: %s", e)
        return None
