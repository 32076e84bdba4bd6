"""A step's masks, computed from its rows' constraints while the model runs.

`Masker.start` computes the masks of a step's sampled rows on a worker thread while the
engine thread launches (on the CPU: runs) the model step. The grammar engine writes them in
Rust, without the GIL, as bitmask rows (a bit per token) into host memory that is pinned
for a GPU; `StepMasks.apply` copies the step's rows to the logits' device in one
non-blocking copy and rules out the clear bits there with one kernel. Nothing on either
thread walks the vocabulary in Python: the worker only sets or clears the bits of a few
tokens (stop tokens, a forced token), so it hardly takes the GIL from the engine thread.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from queue import Empty, SimpleQueue

import llguidance
import numpy as np
import torch

from freetoken.runtime import sampling
from freetoken.runtime.constrain import GRAMMAR, Constraint, set_bits

__all__ = ["EMPTY", "MASKED", "Mask", "Masker", "Masks", "StepMasks"]

MASKED, EMPTY = "masked", "empty"  # a row's mask is in the step's bits / it allows nothing
_ALL = np.uint32(0xFFFFFFFF)  # a free row's words
_NOTHING = (False, np.empty(0, dtype=np.int64))  # a host plan that rules nothing out


@dataclass(frozen=True, slots=True)
class Mask:
    """One row's mask as token ids (tests and the bench read it so): those allowed
    (`allow`) or those ruled out, whichever are fewer, out of `size`."""

    ids: np.ndarray  # int64 token ids
    allow: bool
    size: int

    @property
    def empty(self) -> bool:
        """Nothing is allowed (a grammar in error): the sequence cannot go on."""
        return self.allow and self.ids.size == 0 or not self.allow and self.ids.size >= self.size

    def allowed(self) -> np.ndarray:
        """The allowed token ids, sorted."""
        return self.ids if self.allow else np.setdiff1d(np.arange(self.size), self.ids)

    @classmethod
    def of_bits(cls, row: np.ndarray, size: int) -> Mask:
        on = np.unpackbits(row.view(np.uint8), bitorder="little", count=size).view(bool)
        if np.count_nonzero(on) <= size // 2:
            return cls(np.flatnonzero(on), True, size)
        return cls(np.flatnonzero(~on), False, size)


class _Rows:
    """Host rows the worker writes a step's bitmasks into: pinned where the logits are on a
    GPU, so the copy out of them waits for nothing, with the event of that copy (the worker
    writes them again only once it is done)."""

    def __init__(self, pin: bool):
        self.pin, self.bits = pin, torch.empty(0, 0, dtype=torch.int32)
        self.copied: torch.cuda.Event | None = None  # recorded again each time: no new one
        self.pending = False  # the copy was recorded and not yet waited for

    def take(self, rows: int, words: int) -> torch.Tensor:
        if self.pending:
            self.copied.synchronize()  # two steps old: long done, unless no token was read
            self.pending = False
        if self.bits.shape[0] < rows or self.bits.shape[1] != words:
            rows = max(rows, 2 * self.bits.shape[0])  # pinning costs: grow seldom
            self.bits = torch.empty(rows, words, dtype=torch.int32, pin_memory=self.pin)
        return self.bits

    def mark(self) -> None:
        """Records the copy of these rows just queued on the current stream."""
        if self.copied is None:
            self.copied = torch.cuda.Event()
        self.copied.record()
        self.pending = True


class StepMasks:
    """A step's masks. `state[i]` of each sampled row: None (free), MASKED, EMPTY (its grammar
    allows nothing: the sequence cannot go on) or the exception its constraint raised (that
    sequence alone ends with it). Where any row is constrained, row i of `bits` (host int32
    words) is sampled row i's bitmask, all ones for a free row (what a failed or empty row
    holds there is never read: it draws no token)."""

    def __init__(
        self,
        state: list,
        bits: torch.Tensor | None = None,
        size: int = 0,
        source: _Rows | None = None,
        plans: list | None = None,
    ) -> None:
        self.state, self.bits, self.size, self._source = state, bits, size, source
        self.plans = plans  # each row's sampling.host_plan, for logits on the CPU

    @property
    def rows(self) -> int:
        return len(self.state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """fp32 logits [rows, V] with what each mask rules out at -inf, on the logits' device:
        one copy of the step's words and one kernel over the batch (none where every row is
        free), whatever the masks hold."""
        scores = logits.float()
        if self.bits is None:
            return scores
        plans = self.plans if scores.shape[-1] == self.size else None
        sampling.mask_bits(scores, self.bits[: self.rows], plans)
        if scores.is_cuda and self._source is not None:
            self._source.mark()  # its rows' copy: see _Rows
        return scores

    def words(self, i: int) -> np.ndarray:
        """Row i's bitmask as uint32 words."""
        return self.bits[i].numpy().view(np.uint32)

    def allows(self, i: int, token: int) -> bool:
        return self.state[i] is MASKED and bool(self.words(i)[token >> 5] >> (token & 31) & 1)

    def mask(self, i: int) -> Mask | Exception | None:
        s = self.state[i]
        if s is None or _failed(s):
            return s
        if s is EMPTY:
            return Mask(np.empty(0, dtype=np.int64), True, self.size)
        return Mask.of_bits(self.words(i), self.size)


class Masks:
    """A step's masks, being computed on the worker or ready."""

    def __init__(self, ready: StepMasks | None = None, done: SimpleQueue | None = None):
        self._ready, self._done = ready, done

    def wait(self) -> StepMasks:
        if self._ready is None:
            out = self._done.get()  # waits without the GIL
            if isinstance(out, BaseException):
                raise out
            self._ready = out
        return self._ready


class Masker:
    """Computes a step's masks on one worker thread while the engine thread runs the model
    step. The grammar engine writes them as bitmask rows in Rust without the GIL (several
    rows in parallel where it has cores); what is left in Python is a few bits per row
    (stop tokens, forced tokens), so the worker barely contends with the engine thread for
    the GIL. Two sets of rows alternate, so a step's rows are written while the previous
    step's may still be on their way to the device. For logits on the CPU the worker also
    makes each row's host plan (the few ids to scatter), so the engine thread only
    scatters them.

    The engine thread's share is a put and a get on two queues: each row's plan, the rows'
    buffer and the wait for its previous copy are the worker's (a pool's future, a plan a
    row and an event a step cost it tens of µs a step, against a step of about 1 ms)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        device = torch.device(device)
        self._jobs: SimpleQueue | None = None
        self._done: SimpleQueue = SimpleQueue()
        self._last: Masks | None = None  # the job in flight, if its step never waited
        self._executor: llguidance.LLExecutor | None = None
        self._sets = [_Rows(device.type == "cuda"), _Rows(device.type == "cuda")]
        self._turn = 0
        self._host = device.type == "cpu"

    def start(self, rows: list[Constraint | None]) -> Masks:
        """Begins computing the masks of a step's sampled rows (their constraints)."""
        if self._last is not None:
            self._settle()
        if all(c is None for c in rows):
            return Masks(StepMasks([None] * len(rows)))
        self._turn ^= 1
        if self._jobs is None:
            self._jobs = SimpleQueue()
            # not a daemon: one ended at interpreter exit while inside torch's C++ (a copy
            # into the rows' buffer) aborts the process; it sees the main thread end instead
            threading.Thread(
                target=_serve, args=(self._jobs, self._done), name="freetoken-masks"
            ).start()
            weakref.finalize(self, self._jobs.put, None)  # the worker ends with the masker
        self._jobs.put((self._run, rows, self._sets[self._turn]))
        self._last = Masks(done=self._done)
        return self._last

    def _settle(self) -> None:
        """Takes the result of a job whose step failed before waiting for it (its result
        would be taken for the next step's)."""
        last, self._last = self._last, None
        try:
            last.wait()
        except Exception:
            pass  # its step is gone

    def fill(self, rows: list[Constraint | None]) -> StepMasks:
        """The same masks, on the calling thread (the worker's work, as the bench times it)."""
        return self._run(rows)

    def compute(self, rows: list[Constraint | None]) -> list[Mask | Exception | None]:
        """Each row's mask as token ids (tests)."""
        step = self.fill(rows)
        return [step.mask(i) for i in range(step.rows)]

    def _run(self, rows: list, target: _Rows | None = None) -> StepMasks:
        plans = _plans(rows)
        first = _first(plans)
        if first is None:
            return StepMasks(plans)
        shape = (len(rows), _words(rows[first]))
        bits = target.take(*shape) if target is not None else torch.empty(shape, dtype=torch.int32)
        return self._fill(rows, plans, bits, target)

    def _fill(self, rows: list, plans: list, bits: torch.Tensor, target: _Rows | None) -> StepMasks:
        state: list = list(plans)  # free rows and failures stand
        words = bits.numpy().view(np.uint32)
        grammar = [(rows[i].matcher, i) for i, p in enumerate(plans) if p == GRAMMAR]
        failed = self._grammar_rows(grammar, bits)
        size = rows[_first(plans)].vocab.size
        host: list | None = [_NOTHING] * len(rows) if self._host else None
        for i, p in enumerate(plans):
            if p is None or _failed(p) or i in failed:
                words[i] = _ALL  # drawn as they are (a failed row is not drawn)
                state[i] = failed.get(i, p)
                continue
            try:
                if p == GRAMMAR:
                    rows[i].adjust(words[i])
                else:
                    words[i] = 0
                    set_bits(words[i], np.array(p, dtype=np.int64), True)
                state[i] = MASKED if words[i].any() else EMPTY
                if host is not None:
                    host[i] = sampling.host_plan(words[i], size)
            except Exception as e:
                state[i] = e
        return StepMasks(state, bits, size, target, host)

    def _grammar_rows(self, grammar: list, bits: torch.Tensor) -> dict[int, Exception]:
        """Writes the grammar rows' bitmasks (row k of `bits` for each (matcher, k)); the
        exception of each row whose matcher failed, by row."""
        if not grammar:
            return {}
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        where = (bits.data_ptr(), bits.shape[1] * 4, bits.shape[0])
        try:
            self._executor.unsafe_compute_mask_ptr(grammar, *where)
            return {}
        except Exception:  # one matcher's fault: each row alone, so the others go on
            failed = {}
            for one in grammar:
                try:
                    self._executor.unsafe_compute_mask_ptr([one], *where)
                except Exception as e:
                    failed[one[1]] = e
            return failed


# how often an idle worker looks whether the main thread has ended
_IDLE_S = 0.2


def _serve(jobs: SimpleQueue, done: SimpleQueue) -> None:
    """The worker: each job's result (or what it raised) in order, until None or the main
    thread's end (interpreter exit joins threads like this one)."""
    main = threading.main_thread()
    while True:
        try:
            job = jobs.get(timeout=_IDLE_S)
        except Empty:
            if main.is_alive():
                continue
            return
        if job is None:
            return
        fn, *args = job
        try:
            done.put(fn(*args))
        except BaseException as e:  # the engine thread raises it
            done.put(e)


def _failed(state: object) -> bool:
    return isinstance(state, Exception)


def _first(plans: list) -> int | None:
    """The first row with a mask to compute (None: every row is free or failed)."""
    return next((i for i, p in enumerate(plans) if p is not None and not _failed(p)), None)


def _words(c: Constraint) -> int:
    return (c.vocab.size + 31) // 32


def _plans(rows: list[Constraint | None]) -> list[tuple[int, ...] | str | Exception | None]:
    """Each row's plan (Constraint.plan), or the exception its constraint raised."""
    out: list[tuple[int, ...] | str | Exception | None] = []
    for c in rows:
        try:
            out.append(c.plan() if c is not None else None)
        except Exception as e:
            out.append(e)
    return out
