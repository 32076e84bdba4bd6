"""Expert parallelism behind the experts op: each rank serves its own block of every layer's
experts.

One experts op over the group, for decode, prefill chunks and batches alike:
  1. rank 0 sends the header and broadcasts the layer's hidden states, routes and weights;
  2. every rank runs the routes that go to its experts through its own offload backend (its
     GPU cache, its PCIe link, the host CPU the ranks share), one row per route;
  3. the partial outputs are summed into rank 0's (a reduce, in fp32).
Each route is computed exactly once, on the rank that owns its expert.

A broadcast and a reduce, not an all-to-all: at bs=1 decode the payload is one hidden state
and k routes (a few KB, latency-bound either way), and an all-to-all would first need a
round to exchange per-rank counts. A prefill chunk's broadcast is [T, H], small next to
the layer of experts that each rank streams over its PCIe link meanwhile.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from freetoken.dist.group import EXPERTS, IDLE, RESIZE, STATS, WARM, Group
from freetoken.moe import setup
from freetoken.moe.backend import ExpertBackend, attach
from freetoken.moe.offload import OffloadExperts

log = logging.getLogger(__name__)


def pack(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """One byte buffer: routes (int32) first, then hidden states and weights in x's dtype, so
    every part starts aligned for its own dtype."""
    parts = (ids.to(torch.int32), x, weights.to(x.dtype))
    return torch.cat([p.contiguous().view(-1).view(torch.uint8) for p in parts])


def unpack(
    buf: torch.Tensor, T: int, k: int, hidden: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n_ids, n_x = T * k * 4, T * hidden * dtype.itemsize
    ids = buf[:n_ids].view(torch.int32).view(T, k).long()
    x = buf[n_ids : n_ids + n_x].view(dtype).view(T, hidden)
    weights = buf[n_ids + n_x :].view(dtype).view(T, k)
    return x, ids, weights


def payload_bytes(T: int, k: int, hidden: int, dtype: torch.dtype) -> int:
    return T * k * 4 + (T * hidden + T * k) * dtype.itemsize


def local_part(
    backend: OffloadExperts,
    owned: tuple[int, int],
    layer: int,
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
) -> torch.Tensor:
    """Σ over the routes to experts [lo, hi) only, in fp32 [T, H]; zeros where none go.

    The local backend sees one row per route (k = 1) with expert ids local to its banks.
    """
    lo, hi = owned
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    tok, col = ((ids >= lo) & (ids < hi)).nonzero(as_tuple=True)
    if tok.numel():
        y = backend(
            layer, x[tok], (ids[tok, col] - lo)[:, None], weights[tok, col][:, None]
        )  # [R, H]
        out.index_add_(0, tok, y.float())
    return out


def try_resize(backend: OffloadExperts, slots: int) -> dict:
    """A rank's resize result, or its refusal as {"error"}: every rank answers either way."""
    try:
        return backend.resize(slots)
    except Exception as e:
        return {"error": str(e)}


class DistributedExperts(ExpertBackend):
    """Rank 0's experts op: every call is one operation of the whole group. Steps run on
    rank 0's own backend too (`local`), so what the contract asks of a single process —
    graph capture, between-step hand-overs, the step wait — is the local backend's."""

    def __init__(self, group: Group, local: OffloadExperts, statuses: list[dict]):
        self.group, self.local = group, local
        self.ranks = [
            {k: s[k] for k in ("rank", "pid", "device", "experts", "bank_bytes")} for s in statuses
        ]
        self.followers = [s["stats"] for s in statuses[1:]]  # as of their last report
        self.vram = [s.get("vram_bytes", 0) for s in statuses]

    def __call__(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        T, k = ids.shape
        g = self.group
        with g.op():
            g.send(EXPERTS, layer, T, k)
            g.broadcast(pack(x, ids, weights))
            out = local_part(self.local, g.experts, layer, x, ids, weights)
            g.reduce(out)
        return out.to(x.dtype)

    # --- a step: every layer is a collective, so none stays inside a graph ---------------
    def device_only(self, layer: int, tokens: int = 1) -> bool:
        return False

    def account_device(self, layer: int, routes: int) -> None:
        self.local.account_device(layer, routes)

    def use_routers(self, routers: dict) -> None:
        """No guesses: each rank's books keep only its own experts, and a layer's routes
        reach the ranks together (the local backend was built without lookahead)."""

    def between_steps(self, tokens: int) -> None:
        self.local.between_steps(tokens)

    @property
    def generation(self):
        return self.local.generation

    @property
    def variant(self):
        return self.local.variant

    def keep_books_on_host(self) -> bool:
        return self.local.keep_books_on_host()

    def wait_step(self) -> None:
        self.local.wait_step()

    @property
    def waits_asleep(self) -> bool:
        return self.local.waits_asleep

    # --- memory ----------------------------------------------------------------------------
    @property
    def policy(self) -> str:
        return self.local.policy

    @property
    def capacity(self) -> int:
        return self.local.capacity

    @property
    def expert_bytes(self) -> int:
        return self.local.expert_bytes

    @property
    def floor(self) -> int:
        return self.local.floor

    @property
    def host_bytes(self) -> int:
        """Host memory of every rank's banks: the whole model's experts, held once."""
        return sum(r["bank_bytes"] for r in self.ranks)

    @property
    def vram_elsewhere(self) -> int:
        return sum(self.vram[1:])

    def counters(self) -> dict:
        """Rank 0's own counters (the followers report theirs in `stats`)."""
        return self.local.counters()

    # --- operations between steps ----------------------------------------------------------
    def resize(self, slots: int) -> dict:
        """Every rank's pool to `slots` (per GPU); raises ValueError naming the ranks that
        refused."""
        g = self.group
        with g.op():
            g.send(RESIZE, int(slots))
            results = g.gather(try_resize(self.local, int(slots)))
            g.send(STATS)
            self._keep(g.gather(self.local.stats()))
        errors = [f"rank {r}: {res['error']}" for r, res in enumerate(results) if "error" in res]
        if errors:
            raise ValueError("; ".join(errors))
        return {**results[0], "ranks": results}

    def warm(self, seed: int = 0) -> None:
        with self.group.op():
            self.group.send(WARM, seed)
            self.local.warm(seed)

    def idle(self) -> None:
        """Called when the engine has no work: followers report their stats, then wait on the
        control group (no NCCL kernel spins on their GPUs while the model is idle)."""
        g = self.group
        if not g.awake or g.dead is not None:
            return
        with g.op():
            g.send(STATS)
            self._keep(g.gather(self.local.stats()))
            g.send(IDLE)

    def _keep(self, stats: list[dict]) -> None:
        self.followers = stats[1:]

    def stats(self) -> dict:
        """Rank 0's stats, each rank's (followers' as of their last report: when the group last
        went idle or resized), and the expert cache summed over the ranks."""
        mine = self.local.stats()
        per_rank = [mine, *self.followers]
        out = {**mine, "ranks": [{**info, **s} for info, s in zip(self.ranks, per_rank)]}
        caches = [s["cache"] for s in per_rank if s.get("cache")]
        if caches:
            keys = ("slots", "bytes", "used", "hits", "misses", "fetches", "evictions")
            total = {key: sum(c[key] for c in caches) for key in keys}
            lookups = total["hits"] + total["misses"]
            out["cache"] = {**total, "hit_rate": total["hits"] / lookups if lookups else 0.0}
        return out

    def close(self) -> None:
        self.group.close()
        self.local.close()


def status(group: Group, backend: OffloadExperts | None, error: str | None = None) -> dict:
    """What a rank reports once it has loaded its share (or failed to)."""
    out = {
        "rank": group.rank,
        "pid": os.getpid(),
        "device": str(group.device),
        "experts": list(group.experts),
    }
    if error is not None:
        return {**out, "error": error}
    vram = torch.cuda.memory_allocated(group.device) if group.device.type == "cuda" else 0
    return {
        **out,
        "bank_bytes": backend.host_bytes,
        "vram_bytes": vram,
        "stats": backend.stats(),
    }


def install(
    model: nn.Module,
    banks: dict,
    device: torch.device,
    dtype: torch.dtype,
    placement: setup.Placement,
    group: Group,
    formats: dict | None = None,
) -> DistributedExperts:
    """Rank 0: its share of the experts behind the model's experts ops, once every rank has
    loaded its own. A rank that failed to load fails the whole load, by name."""
    try:
        spec = setup.expert_spec(model)
        local = setup.build(
            banks, spec, device, dtype, placement, ranks_on_host=group.world, formats=formats
        )
        mine = status(group, local)
    except Exception as e:
        local, mine = None, status(group, None, f"{type(e).__name__}: {e}")
    statuses = group.gather(mine)
    errors = [f"rank {s['rank']} ({s['device']}): {s['error']}" for s in statuses if "error" in s]
    if errors:
        group.close()
        raise RuntimeError("; ".join(errors))
    backend = DistributedExperts(group, local, statuses)
    attach(model, backend, local.banks.layers)
    log.info(
        "experts over %d ranks: %s",
        group.world,
        ", ".join(
            f"{r['device']} experts [{r['experts'][0]}, {r['experts'][1]})" for r in backend.ranks
        ),
    )
    return backend


__all__ = ["DistributedExperts", "install", "local_part", "pack", "unpack"]
