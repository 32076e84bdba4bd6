"""The engine: schedule a step, run the model on it, sample, detokenize, finish.

`step()` is plan -> execute -> postprocess. All state changes happen on the thread that
calls it; requests arrive and leave through `add` / `abort`, which only queue work.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from freetoken.layers.context import SeqSpan, StepContext, step_context
from freetoken.moe.backend import ExpertsOps
from freetoken.runtime import batch_draw, sampling
from freetoken.runtime.anchors import Anchoring
from freetoken.runtime.detok import Detokenizer, StopMatcher
from freetoken.runtime.graphs import DecodeGraphs, decode_plan
from freetoken.runtime.kv_cache import KVCache
from freetoken.runtime.masks import EMPTY, Masker, StepMasks
from freetoken.runtime.overlap import Ahead, Readback, refusal
from freetoken.runtime.prefix_cache import Match, PrefixCache, divergence
from freetoken.runtime.scheduler import Plan, Scheduler
from freetoken.runtime.sequence import Sequence, Status
from freetoken.runtime.state_cache import StateCache
from freetoken.runtime.tokenizer import Tokenizer

log = logging.getLogger("freetoken.runner")

# Called on the engine thread with (sequence, text delta, finished).
OutputFn = Callable[[Sequence, str, bool], None]


@dataclass(eq=False)
class Request:
    seq: Sequence
    on_output: OutputFn
    detok: Detokenizer
    stops: StopMatcher
    generator: torch.Generator | None
    t_submit: int = field(default_factory=time.perf_counter_ns)


class Engine:
    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Tokenizer,
        kv: KVCache,
        device: torch.device,
        num_ctx: int,
        max_running: int,
        prefill_chunk: int,
        graphs: DecodeGraphs | None = None,
        prefix_cache: bool = False,
        state: StateCache | None = None,
        anchoring: Anchoring | None = None,
        overlap: bool = False,
    ):
        """overlap: launch a decode step before the last one's tokens are read, where it can
        be (runtime/overlap.py); it needs `graphs`."""
        self.model, self.tokenizer, self.kv, self.device = model, tokenizer, kv, device
        self.graphs, self.state = graphs, state
        self.vocab_size = model.args.vocab_size  # token ids a step can embed
        self._ops = ExpertsOps(model)
        self.num_ctx = num_ctx
        prefix = PrefixCache(kv.pool, kv.page_size, kv.copy_page) if prefix_cache else None
        self.anchoring = anchoring
        store = anchoring.store if anchoring is not None else None
        self.scheduler = Scheduler(
            kv, max_running, prefill_chunk, prefix, self._matched, state, store
        )
        self.requests: dict[int, Request] = {}
        self._inbox: list[tuple[str, Request | int]] = []
        self._lock = threading.Condition()
        self.steps = 0
        self.decoded = 0  # tokens sampled, over all sequences (the cache's windows count by it)
        self.masker = Masker(device)
        self.overlap = overlap and graphs is not None
        self._ahead: Ahead | None = None  # a step launched whose tokens are not read yet
        # the engine thread's time in steps, and of it the time waiting for tokens
        self.busy_ns = self.wait_ns = 0
        self.ahead_steps = 0  # steps launched before the last one's tokens were read
        self.ahead_refused: Counter[str] = Counter()  # why the others were not

    # --- called from other threads -------------------------------------------------
    def submit(self, seq: Sequence, on_output: OutputFn) -> None:
        if self.anchoring is not None:
            seq.anchor_at = self.anchoring.positions(seq.prompt_ids)
            seq.mark_at = self.anchoring.marks(seq.prompt_ids)
        req = Request(
            seq,
            on_output,
            Detokenizer(functools.partial(self.tokenizer.decode, shown=seq.shown_ids)),
            StopMatcher(seq.params.stop),
            sampling.make_generator(seq.params, self.device),
        )
        with self._lock:
            self._inbox.append(("add", req))
            self._lock.notify()

    def call_between_steps(self, fn: Callable[[], object]) -> Future:
        """Runs fn on the engine thread before the next step (resizes happen here, never
        mid-step)."""
        fut: Future = Future()
        with self._lock:
            self._inbox.append(("call", (fn, fut)))
            self._lock.notify()
        return fut

    def abort(self, seq_id: int) -> None:
        with self._lock:
            self._inbox.append(("abort", seq_id))
            self._lock.notify()

    def wait_for_work(self, timeout: float | None = None) -> None:
        with self._lock:
            if not self._inbox and not self.scheduler.has_work and self._ahead is None:
                self._lock.wait(timeout)

    # --- engine thread --------------------------------------------------------------
    def step(self) -> int:
        """Runs one step; returns how many tokens it fed to the model."""
        t = time.perf_counter_ns()
        try:
            return self._step()
        finally:
            self.busy_ns += time.perf_counter_ns() - t

    def _step(self) -> int:
        self._drain_inbox(calls=self._ahead is None)  # nothing runs between steps mid-step
        if self._ahead is not None:
            return self._land(self._ahead)
        plan = self.scheduler.schedule()
        if not plan:
            return 0
        t0 = time.perf_counter_ns()
        pending = self.masker.start(self._constraints(plan))  # computed while the model runs
        logits = self._execute(plan)
        experts = self._ops.backend
        ahead = self.overlap and self._may_chain(plan)
        if self.overlap and not ahead:
            self.ahead_refused["plan"] += 1  # a prefill chunk, or a shape past the graphs
        if experts is not None and not ahead:
            experts.wait_step()
        t1 = time.perf_counter_ns()
        masks = pending.wait()
        self._postprocess(plan, logits, masks, t0, t1, ahead)
        self.steps += 1
        self.decoded += masks.rows
        return sum(n for _, n in plan)

    def _drain_inbox(self, calls: bool = True) -> None:
        """Takes what other threads queued; `calls=False` leaves the calls between steps
        queued (a step is in flight)."""
        with self._lock:
            inbox, self._inbox = self._inbox, []
            if not calls:
                self._inbox = [x for x in inbox if x[0] == "call"]
                inbox = [x for x in inbox if x[0] != "call"]
        for kind, item in inbox:
            if kind == "add":
                self.requests[item.seq.id] = item
                if bad := self._bad_token(item.seq):
                    # an id past the embedding would fail the whole step, every sequence in it
                    self._fail(item, f"token id {bad} is not in the vocabulary")
                    continue
                self.scheduler.add(item.seq)
            elif kind == "call":
                fn, fut = item
                try:
                    fut.set_result(fn())
                except Exception as e:  # the caller gets it; the engine goes on
                    fut.set_exception(e)
            elif item in self.requests:
                self._finish(self.requests[item], "abort", emit=False)

    def _bad_token(self, seq: Sequence) -> int | None:
        return next((t for t in seq.prompt_ids if not 0 <= t < self.vocab_size), None)

    def _between_steps(self, tokens: int) -> None:
        """Lets the expert backend change placement now, never in the middle of a step."""
        if (experts := self._ops.backend) is not None:
            experts.between_steps(tokens)

    @torch.inference_mode()
    def _execute(self, plan: Plan) -> torch.Tensor:
        self._between_steps(sum(n for _, n in plan))
        if (
            self.graphs is not None
            and decode_plan(plan)
            and self.graphs.fits(len(plan), max(seq.num_tokens for seq, _ in plan))
        ):
            return self.graphs.run(
                [seq.token_at(seq.num_cached) for seq, _ in plan],
                [seq.num_cached for seq, _ in plan],
                [seq.pages for seq, _ in plan],
                [seq.state_slot or 0 for seq, _ in plan],
            )
        ids: list[int] = []
        positions: list[int] = []
        spans: list[SeqSpan] = []
        slots: list[torch.Tensor] = []
        sample_rows: list[int] = []
        for seq, n in plan:
            start = seq.num_cached
            ids += seq.tokens[start : start + n]
            positions += range(start, start + n)
            ctx_slots = self.kv.slots_of(seq.pages, 0, start + n, self.device)
            marks = self.anchoring.span_marks(seq, start, n) if self.anchoring else ()
            spans.append(SeqSpan(len(ids) - n, n, start + n, ctx_slots, marks))
            slots.append(ctx_slots[start:])
            if start + n == seq.num_tokens:
                sample_rows.append(len(ids) - 1)
        dev = self.device
        ctx = StepContext(
            positions=torch.tensor(positions, device=dev),
            slots=torch.cat(slots),
            seqs=spans,
            kv=self.kv,
            logits_index=torch.tensor(sample_rows, dtype=torch.long, device=dev),
            state=self.state,
            state_slots=self._state_slots(plan),
        )
        with step_context(ctx):
            hidden = self.model(torch.tensor(ids, device=dev), ctx.positions)
            if ctx.marked:
                seqs = [seq for seq, _ in plan]
                self.anchoring.keep_marked(seqs, [s.num_cached for s in seqs], ctx.marked)
            if not sample_rows:
                return torch.empty(0)
            return self.model.logits(hidden[ctx.logits_index])

    def _state_slots(self, plan: Plan) -> torch.Tensor | None:
        """Each planned sequence's state slot, in plan order (None: no recurrent layers)."""
        if self.state is None:
            return None
        slots = [seq.state_slot for seq, _ in plan]
        return torch.tensor(slots, dtype=torch.long, device=self.device)

    @staticmethod
    def _constraints(plan: Plan) -> list:
        """The constraint of each sequence that samples this step (None: free)."""
        return [seq.constraint for seq, n in plan if seq.num_cached + n == seq.num_tokens]

    def _postprocess(
        self,
        plan: Plan,
        logits: torch.Tensor,
        masks: StepMasks,
        t0: int,
        t1: int,
        ahead: bool = False,
    ) -> None:
        """Draws the step's tokens; with `ahead`, launches the next step before reading
        them where it can."""
        rows = []
        for seq, n in plan:
            seq.num_cached += n
            self.scheduler.cache_pages(seq)
            if self.anchoring is not None:
                self.anchoring.after_step(seq)
            if seq.num_cached == seq.num_tokens:  # else a prefill chunk short of the prompt's end
                rows.append(self.requests[seq.id])
        drawn = self._draw_rows(rows, masks.apply(logits), masks)
        readback = Readback([t for *_, t in drawn], self._sleeps)
        if ahead and len(drawn) == len(plan):
            self._ahead = self._chain([r.seq for r, *_ in drawn], [t for *_, t in drawn])
        tokens = self._read(readback)
        self._take_all(drawn, tokens, time.perf_counter_ns() if ahead else t1)

    def _draw_rows(self, reqs: list[Request], scores: torch.Tensor, masks: StepMasks) -> list:
        """(request, its scores, its token on the device) of each row that drew; `scores`:
        fp32 [rows, V], each constrained row's mask applied. Rows alike draw together
        (runtime/batch_draw.py)."""
        live = []
        for row, req in enumerate(reqs):
            try:
                # what fails here is this sequence's own (its grammar, its options): it ends
                # with the error, the batch goes on
                if self._may_draw(req, masks.state[row]):
                    live.append(row)
            except Exception as e:
                self._fail_one(req, e)
        try:
            tokens = self._draw_live(reqs, live, scores)
        except Exception:  # one row's options failed its group: each alone, to find it
            tokens, kept = [], []
            for row in live:
                try:
                    tokens += self._draw_live(reqs, [row], scores)
                    kept.append(row)
                except Exception as e:
                    self._fail_one(reqs[row], e)
            live = kept
        return [(reqs[row], scores[row], token) for row, token in zip(live, tokens)]

    def _take_all(self, drawn: list, tokens: list[int], t1: int) -> None:
        """Accepts each row's token; `t1`: when the step's logits were known."""
        for (req, scores, _), token in zip(drawn, tokens):
            seq = req.seq
            if not seq.output_ids:
                seq.prefill_ns = t1 - req.t_submit
                seq.first_token_ns = t1
            seq.decode_ns = t1 - seq.first_token_ns
            try:
                self._take(req, scores, token)
            except Exception as e:  # its logprobs, its grammar, its output parser
                self._fail_one(req, e)

    def _read(self, readback: Readback) -> list[int]:
        """The step's tokens drawn on the logits' device, read back together: where the
        engine thread waits for the device."""
        t = time.perf_counter_ns()
        tokens = readback.wait()
        self.wait_ns += time.perf_counter_ns() - t
        return tokens

    @property
    def _sleeps(self) -> bool:
        experts = self._ops.backend
        return experts is not None and experts.waits_asleep

    # --- steps launched ahead (runtime/overlap.py) ----------------------------------------
    def _may_chain(self, plan: Plan) -> bool:
        """Whether the step just launched was a decode step from the graphs, which the next
        may follow before its tokens are read."""
        return decode_plan(plan) and self.graphs.fits(
            len(plan), max(seq.num_tokens for seq, _ in plan)
        )

    def _chain(self, seqs: list[Sequence], drawn: list[torch.Tensor]) -> Ahead | None:
        """Launches the next decode step of `seqs`, fed the tokens just drawn on the device
        (`drawn`, not yet read); None where it cannot run ahead. Its tokens are drawn when it
        lands, once the host has taken these (their masks and penalties follow them)."""
        B = len(seqs)
        with self._lock:
            queued = bool(self._inbox)  # a call waits for no step in flight; a request too
        if refused := refusal(seqs, queued, self.scheduler, self.graphs, self.num_ctx):
            self.ahead_refused[refused] += 1
            return None
        with torch.inference_mode():
            self._between_steps(B)
            logits = self.graphs.run(
                [],
                [seq.num_cached for seq in seqs],
                [seq.pages for seq in seqs],
                ids=torch.stack(drawn),
            )
        self.ahead_steps += 1
        return Ahead(seqs, logits)

    def _land(self, ahead: Ahead) -> int:
        """Draws and reads the step launched ahead (launching the one after it first, where
        it can) and takes its tokens; the rows of sequences that ended meanwhile are dropped."""
        self._ahead = None
        kept = [i for i, seq in enumerate(ahead.seqs) if seq.id in self.requests]
        reqs = [self.requests[ahead.seqs[i].id] for i in kept]
        for req in reqs:
            req.seq.num_cached += 1
            self.scheduler.cache_pages(req.seq)
        masks = self.masker.start([req.seq.constraint for req in reqs]).wait()
        drawn = []
        if kept:
            with torch.inference_mode():
                # the rows' own copy, as the step launched next writes the graph's logits
                # again; stacked, since an index tensor built on the device would make the
                # host wait for this step's forward before the next one is launched
                scores = masks.apply(torch.stack([ahead.logits[i] for i in kept]))
                drawn = self._draw_rows(reqs, scores, masks)
        readback = Readback([t for *_, t in drawn], self._sleeps)
        if len(drawn) == len(ahead.seqs):
            self._ahead = self._chain([r.seq for r, *_ in drawn], [t for *_, t in drawn])
        tokens = self._read(readback)
        self._take_all(drawn, tokens, time.perf_counter_ns())
        self.steps += 1
        self.decoded += len(reqs)
        return len(ahead.seqs)

    def _may_draw(self, req: Request, mask: object) -> bool:
        """Whether the row draws (False: it has ended); `mask`: its row's state in
        StepMasks."""
        if isinstance(mask, Exception):  # its grammar's mask could not be computed
            raise mask
        if mask is EMPTY:  # cannot happen with a sound grammar; never sample NaN
            self._finish(req, "stop")
            return False
        return True

    def _draw_live(self, reqs: list[Request], rows: list[int], scores: torch.Tensor) -> list:
        seqs = [reqs[row].seq for row in rows]
        return batch_draw.draw_rows(
            scores,
            rows,
            [seq.tokens if sampling.penalized(seq.params) else [] for seq in seqs],
            [seq.params for seq in seqs],
            [reqs[row].generator for row in rows],
            self.num_ctx,
        )

    def _take(self, req: Request, scores: torch.Tensor, token: int) -> None:
        seq = req.seq
        if seq.top_logprobs is not None and token not in seq.stop_ids:
            lp, top = sampling.token_logprobs(scores, token, seq.top_logprobs)
            seq.logprobs.append((token, lp, top))
        self._accept(req, token)

    def _fail_one(self, req: Request, e: Exception) -> None:
        log.error("sequence %d failed: %s", req.seq.id, e, exc_info=e)
        self._fail(req, f"{type(e).__name__}: {e}")

    def _accept(self, req: Request, token: int) -> None:
        seq = req.seq
        if token in seq.stop_ids:
            self._finish(req, "stop")
            return
        seq.output_ids.append(token)
        if seq.constraint is not None:
            seq.constraint.advance(token)
        text, stopped = req.stops.push(req.detok.push(token))
        if stopped:
            req.on_output(seq, text, False) if text else None
            self._finish(req, "stop", emit=False)
            return
        end = None
        if seq.constraint is not None and seq.constraint.finished:
            end = "stop"  # the value is complete: nothing but end-of-text could follow
        elif len(seq.output_ids) >= seq.max_new_tokens:
            end = "length"
        if text:
            req.on_output(seq, text, False)
        if end:
            self._finish(req, end)

    def _finish(self, req: Request, reason: str, emit: bool = True) -> None:
        seq = req.seq
        tail = req.stops.push(req.detok.flush())[0] + req.stops.flush() if emit else ""
        seq.status, seq.finish_reason = Status.FINISHED, reason
        if self.anchoring is not None and reason != "error":
            self.anchoring.after_step(seq, ended=True)  # the next turn may repeat it all
        self.scheduler.remove(seq)
        del self.requests[seq.id]
        req.on_output(seq, tail, True)

    def _fail(self, req: Request, message: str) -> None:
        """Ends one request with an error; its pages go back whatever its output does."""
        seq = req.seq
        seq.error = message
        if seq.id not in self.requests:  # it failed while finishing: already gone
            return
        seq.status, seq.finish_reason = Status.FINISHED, "error"
        self.scheduler.remove(seq)
        del self.requests[seq.id]
        try:
            req.on_output(seq, "", True)
        except Exception:
            log.exception("sequence %d: its error could not be reported", seq.id)

    def _matched(self, seq: Sequence, found: Match) -> None:
        """Says in the debug log how much of a prompt the prefix cache held, and where and
        why the rest differs from what it holds."""
        if log.isEnabledFor(logging.DEBUG) and found.diverged:
            log.debug("prefix cache: %s", divergence(self.tokenizer.decode, seq, found))

    def fail_all(self, message: str) -> None:
        """Ends every request with an error (after a failed step) and frees their pages."""
        self._ahead = None  # what it drew is lost with the step that failed
        for req in list(self.requests.values()):
            self._fail(req, message)

    def stats(self) -> dict:
        pool = self.kv.pool
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_pages_total": pool.num_pages,
            "kv_pages_free": pool.num_free,
            "kv_pages_cached": prefix.cached_pages if (prefix := self.scheduler.prefix) else 0,
            "kv_page_size": self.kv.page_size,
            "kv_bytes": self.kv.bytes,
            **(
                {"state_slots_total": self.state.num_slots, "state_slots_free": self.state.num_free}
                if self.state is not None
                else {}
            ),
            "steps": self.steps,
            "decoded": self.decoded,
            "ahead_steps": self.ahead_steps,
            "ahead_refused": dict(self.ahead_refused),
            "busy_ns": self.busy_ns,
            "wait_ns": self.wait_ns,
        }
