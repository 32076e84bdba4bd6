"""Decode steps replayed from CUDA graphs.

At batch 1 a decode step is a few hundred small kernels; launched one by one from Python
the host, not the GPU, sets the pace (about 80 launches per layer). A decode step in fixed
shapes (`DecodeView`: padded contexts, masked by length) is captured once per (batch size,
context bucket) and replayed, with only tensor contents changing.

A step cannot be one graph when an experts op needs the host (cache lookups, PCIe fetches,
the CPU path): the capture is cut at each such op into segments. Replay runs segment i's
graph, then that experts op eagerly on the segment's outputs, writing into a fixed buffer
the next segment reads. Experts ops that run wholly on the device (resident or fixed
layers, `ExpertBackend.device_only`) stay inside the graphs. Segments share one memory pool and
are always replayed in capture order, which is what makes sharing it safe.

Without capture (`capture=False`, and on a CPU) the same fixed-shape step runs eagerly,
which is how its equivalence with the variable-shape path is tested.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from dataclasses import dataclass, field

import numpy as np
import torch

from freetoken.ftw import hostmem
from freetoken.layers.context import DecodeView, StepContext, step_context
from freetoken.moe.backend import ExpertBackend, ExpertsOps
from freetoken.runtime.kv_cache import KVCache, PagePool
from freetoken.runtime.state_cache import StateCache

log = logging.getLogger(__name__)

MIN_CTX = 256  # smallest context bucket; buckets double from here


@dataclass(eq=False)
class _Cut:
    """An experts op run eagerly between two graphs."""

    backend: ExpertBackend
    layer: int
    x: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor
    out: torch.Tensor


@dataclass(eq=False)
class _Bucket:
    batch: int
    max_ctx: int
    packed: torch.Tensor  # every per-step input, filled by one host-to-device copy
    ctx: StepContext
    input_ids: torch.Tensor
    segments: list[tuple[torch.cuda.CUDAGraph, _Cut | None]] = field(default_factory=list)
    on_device: list[tuple[object, int, int]] = field(
        default_factory=list
    )  # (backend, layer, routes) in graphs
    logits: torch.Tensor | None = None


class DecodeGraphs:
    def __init__(
        self,
        model: torch.nn.Module,
        kv: KVCache,
        device: torch.device,
        max_ctx: int,
        capture: bool = True,
        max_batch: int = 8,
        min_ctx: int = 0,
        state: StateCache | None = None,
    ):
        self.model, self.kv, self.device, self.state = model, kv, device, state
        self.capture = capture and device.type == "cuda"
        self.max_batch = max_batch
        page = kv.page_size
        self.max_ctx = -(-max_ctx // page) * page
        self.min_ctx = min_ctx or MIN_CTX
        self._ops = ExpertsOps(model)
        # every variant's buckets (placements of one generation); `_buckets` is the one in use
        self._buckets: dict[tuple[int, int], _Bucket] = {}
        self._sets: dict[Hashable, dict[tuple[int, int], _Bucket]] = {None: self._buckets}
        self._stream = torch.cuda.Stream(device) if self.capture else None
        self._pool = None
        self._seen: tuple = ()  # the backend's identity and generation the graphs were made for
        self._variant: Hashable = None  # and the variant `_buckets` holds
        self.captures = 0

    def warm(self, pool: PagePool) -> int:
        """Runs (and captures) a decode step of every batch size at the smallest context
        bucket and the largest, and of one sequence at every bucket between, on a page
        borrowed from `pool`, before the first request: the kernels specialised by batch
        size or context compile now (seconds each on a machine that has not seen them), and
        a single answer growing through the buckets captures none of its steps (30-60 ms
        a capture on the H200, against ~0.85 s for a whole 512-token answer). Models
        with recurrent state are left alone (a step would write a state slot). Returns the
        steps run."""
        if self.state is not None:
            return 0
        (page,) = pool.alloc(1)
        steps = 0
        try:
            for ctx, batches in self._warm_shapes():
                pages = [page] * (ctx // self.kv.page_size)
                for B in batches:
                    with torch.inference_mode():
                        self.run([0] * B, [ctx - 1] * B, [pages] * B)
                    steps += 1
        finally:
            pool.release([page])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return steps

    def _warm_shapes(self) -> list[tuple[int, range]]:
        """(context bucket, batch sizes) the load runs: every batch at the ends, one between."""
        ctx, last, shapes = self._bucket_ctx(1), self.max_ctx, []
        every = range(1, self.max_batch + 1)
        while ctx < last:
            shapes.append((ctx, every if not shapes else range(1, 2)))
            ctx = self._bucket_ctx(2 * ctx)
        return [*shapes, (last, every)]

    def fits(self, batch: int, ctx_len: int) -> bool:
        return 1 <= batch <= self.max_batch and ctx_len <= self.max_ctx

    def reset(self) -> None:
        """Drops every captured graph (they hold addresses of tensors that may be replaced)."""
        self._sets = {self._variant: {}}
        self._buckets = self._sets[self._variant]
        self._pool = None

    def _bucket_ctx(self, ctx_len: int) -> int:
        n = self.min_ctx
        while n < ctx_len:
            n *= 2
        page = self.kv.page_size
        return min(-(-n // page) * page, self.max_ctx)

    def _version(self) -> tuple[tuple, Hashable]:
        """(the backend's identity and generation, its variant): a new backend, or a resize
        of the same one, moves the tensors the graphs read; a variant moves none."""
        backend = self._ops.backend
        if backend is None:
            return (), None
        return (id(backend), backend.generation), backend.variant

    def _follow(self) -> None:
        """The graphs the backend's state now needs: all dropped where tensors moved, else
        the variant's own set, kept from its last use. Adaptive moves between placements
        every few hundred steps to measure them, and each move recaptured every graph it
        then ran (30-60 ms a capture): a measurement cost more than its visits."""
        version, variant = self._version()
        if version != self._seen:
            self._variant = variant
            self.reset()
            self._seen = version
        elif variant != self._variant:
            self._variant = variant
            self._buckets = self._sets.setdefault(variant, {})

    @torch.inference_mode()
    def run(
        self,
        tokens: list[int],
        positions: list[int],
        pages: list[list[int]],
        state_slots: list[int] | None = None,
        ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [B, V] of one decode step; valid until the next call. `state_slots`: each
        sequence's recurrent state slot, for models with recurrent layers. `ids`: the tokens
        on the device instead (drawn by a step not yet read back; `tokens` is then unread),
        so nothing here waits for the device."""
        B = len(positions)
        max_ctx = self._bucket_ctx(max(positions) + 1)
        if self.capture:
            self._follow()
        bk = self._buckets.get((B, max_ctx))
        if bk is None:
            bk = self._buckets[(B, max_ctx)] = self._new_bucket(B, max_ctx)
        self._load(bk, tokens if ids is None else [0] * B, positions, pages, state_slots or [0] * B)
        if ids is not None:
            bk.input_ids.copy_(ids)
        if not self.capture:
            return self._forward(bk)
        if not bk.segments:
            try:
                self._capture(bk)
            except RuntimeError as e:  # an op that cannot be captured: decode on, uncaptured
                if self._books_to_host():
                    log.warning(
                        "CUDA graph capture failed with the expert cache's books on the device; "
                        "keeping them on the host: %s",
                        e,
                    )
                    return self.run(tokens, positions, pages, state_slots, ids)
                log.warning("CUDA graph capture failed, decoding without graphs: %s", e)
                self.capture = False
                self.reset()
                return self.run(tokens, positions, pages, state_slots, ids)
        return self._replay(bk)

    def uncut(self, batch: int, ctx_len: int) -> bool:
        """Whether a decode step of this shape runs with no host work inside it: captured as
        one graph (or not captured at all, where every op is the eager one)."""
        if not self.capture:
            return True
        bk = self._buckets.get((batch, self._bucket_ctx(ctx_len)))
        current = self._version() == (self._seen, self._variant)
        return bk is not None and len(bk.segments) == 1 and current

    def _books_to_host(self) -> bool:
        """Asks the experts ops to keep their books on the host (cut graphs, not none)."""
        backend = self._ops.backend
        return backend is not None and backend.keep_books_on_host()

    # --- fixed inputs -----------------------------------------------------------------
    def _new_bucket(self, B: int, max_ctx: int) -> _Bucket:
        P = max_ctx // self.kv.page_size
        packed = torch.zeros(B * (5 + P), dtype=torch.long, device=self.device)
        ids, pos, slots, lens, state_slots = (packed[i * B : (i + 1) * B] for i in range(5))
        table = packed[5 * B :].view(B, P)
        view = DecodeView(block_table=table, lens=lens, page_size=self.kv.page_size)
        ctx = StepContext(
            positions=pos,
            slots=slots,
            seqs=[],
            kv=self.kv,
            logits_index=torch.arange(B, device=self.device),
            decode=view,
            state=self.state,
            state_slots=state_slots,
        )
        return _Bucket(B, max_ctx, packed, ctx, ids)

    def _load(
        self,
        bk: _Bucket,
        tokens: list[int],
        positions: list[int],
        pages: list[list[int]],
        state_slots: list[int],
    ) -> None:
        B, page = bk.batch, self.kv.page_size
        P = bk.max_ctx // page
        host = np.zeros(B * (5 + P), dtype=np.int64)
        host[:B] = tokens
        host[B : 2 * B] = positions
        host[4 * B : 5 * B] = state_slots
        for i, (p, seq_pages) in enumerate(zip(positions, pages)):
            host[2 * B + i] = seq_pages[p // page] * page + p % page
            host[3 * B + i] = p + 1
            n = min(len(seq_pages), P)
            host[5 * B + i * P : 5 * B + i * P + n] = seq_pages[:n]
        staged = torch.from_numpy(host)
        if bk.packed.is_cuda:
            # pinned and queued behind the work before it: a step launched before the last
            # one's tokens are read must not wait for that step here
            staged = staged.pin_memory()
        bk.packed.copy_(staged, non_blocking=True)

    def _forward(self, bk: _Bucket) -> torch.Tensor:
        bk.ctx.decode.derive()
        with step_context(bk.ctx):
            hidden = self.model(bk.input_ids, bk.ctx.positions)
            return self.model.logits(hidden)

    # --- capture and replay -------------------------------------------------------------
    def _capture(self, bk: _Bucket) -> None:
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            # one eager step first: lazy initialisation and kernel compilation must not be
            # captured. It moves the sequences' recurrent state on, which the step replayed
            # next does once more: their state is put back.
            slots = bk.ctx.state_slots
            kept = self.state.save(slots) if self.state is not None else None
            self._forward(bk)
            if kept is not None:
                self.state.restore(slots, kept)
            stream.synchronize()
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            cutter = _Cutter(bk, self._pool)
            backend = self._ops.backend
            saved = self._ops.route_through(cutter.wrap(backend)) if backend else []
            try:
                # a pinned buffer freed inside the capture (the garbage collector runs
                # anywhere) must not unregister there: that call breaks the capture and
                # leaves a registration behind its freed mapping
                with hostmem.capturing():
                    cutter.begin()
                    bk.logits = self._forward(bk)
                    cutter.finish()
            except BaseException:
                cutter.abort()
                raise
            finally:
                self._ops.restore(saved)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self.captures += 1
        log.info(
            "decode step captured: batch %d, context %d, %d graphs, %d experts ops inside them",
            bk.batch,
            bk.max_ctx,
            len(bk.segments),
            len(bk.on_device),
        )

    def _replay(self, bk: _Bucket) -> torch.Tensor:
        for graph, cut in bk.segments:
            graph.replay()
            if cut is not None:
                cut.out.copy_(cut.backend(cut.layer, cut.x, cut.ids, cut.weights))
        for backend, layer, routes in bk.on_device:
            backend.account_device(layer, routes)
        return bk.logits


class _Cutter:
    """Cuts a capture into segments at the experts ops that need the host."""

    def __init__(self, bk: _Bucket, pool):
        self.bk, self.pool = bk, pool
        self.graph: torch.cuda.CUDAGraph | None = None

    def begin(self) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.graph.capture_begin(pool=self.pool)

    def finish(self) -> None:
        self.graph.capture_end()
        self.bk.segments.append((self.graph, None))
        self.graph = None

    def abort(self) -> None:
        if self.graph is not None:
            try:
                self.graph.capture_end()
            except RuntimeError:
                pass  # an invalidated capture also fails to end; the stream is out of capture mode
        self.graph = None
        self.bk.segments.clear()
        self.bk.on_device.clear()

    def wrap(self, backend: ExpertBackend):
        def op(
            layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
        ) -> torch.Tensor:
            if backend.device_only(layer, ids.shape[0]):
                self.bk.on_device.append((backend, layer, ids.numel()))
                return backend(layer, x, ids, weights)
            self.graph.capture_end()
            out = torch.empty_like(x)  # outside any capture: a fixed buffer the next graph reads
            self.bk.segments.append((self.graph, _Cut(backend, layer, x, ids, weights, out)))
            self.begin()
            return out

        return op


def decode_plan(plan) -> bool:
    """True when every sequence of a scheduler plan feeds exactly its one next token."""
    return bool(plan) and all(n == 1 and seq.num_cached + 1 == seq.num_tokens for seq, n in plan)


__all__ = ["DecodeGraphs", "MIN_CTX", "decode_plan"]
