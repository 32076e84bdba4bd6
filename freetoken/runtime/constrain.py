"""Constrained decoding on the llguidance engine: grammars compiled against the model's
vocabulary, each sequence's constraint, and a step's masks computed while the model runs.

`Grammars` compiles a grammar (chat/grammar.py) once and keeps it, most recently used first,
so requests that repeat a schema (an agent's tools, an app's format) start from a copy.

A `Constraint` follows one sequence: a grammar that waits for the thinking section to end
when the output starts with one, and a thinking budget that forces the section's close
marker once it is spent (the format's `thinking_bounds`).

`Masker.start` computes the masks of a step's sampled rows on a worker thread, as bitmask
rows the engine computes in Rust without the GIL, while the engine thread launches (and on
the CPU runs) the model step; `Masks.wait` hands them to sampling as the shorter of two
lists, the tokens allowed or the tokens ruled out, so applying one costs a scatter of the
few (a JSON grammar allows a handful of tokens; free text rules out a handful).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import numpy as np

from freetoken.chat.grammar import Grammar, SchemaError, explain
from freetoken.runtime.vocab import Vocab

__all__ = ["Constraint", "Grammars", "Mask", "Masker", "Masks", "Thinking"]

_GRAMMAR = "grammar"  # a row whose mask the matcher computes


class Grammars:
    """Compiled grammars of one vocabulary, the `limit` most recently used kept."""

    def __init__(self, vocab: Vocab, eos_ids: Collection[int], limit: int = 16):
        self.vocab = vocab
        self.tokenizer = vocab.grammar_tokenizer(eos_ids)
        self.eos_ids = tuple(self.tokenizer.eos_tokens)
        self.limit = limit
        self._lru: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()

    def matcher(self, grammar: Grammar) -> llguidance.LLMatcher:
        """A fresh matcher at the grammar's start; SchemaError if the engine refuses it."""
        found = self._lru.get(grammar.text)
        if found is None:
            found = llguidance.LLMatcher(self.tokenizer, grammar.text, log_level=0)
            if found.is_error():
                raise SchemaError(_why(grammar, found.get_error()))
            self._lru[grammar.text] = found
            if len(self._lru) > self.limit:
                self._lru.popitem(last=False)
        self._lru.move_to_end(grammar.text)
        return found.deep_copy()


def _why(grammar: Grammar, message: str) -> str:
    """The refusal, naming the schema at fault where the grammar embeds several."""
    for label, text in grammar.schemas:
        g = llguidance.LLMatcher.grammar_from_json_schema(text)
        err = llguidance.LLMatcher.validate_grammar(g)
        if err:
            return f"{label}: {explain(err)}"
    return explain(message)


class Thinking:
    """Where the output is inside a thinking section, and the budget spent in it.

    `anywhere`: a section may open at any point (Harmony's analysis messages); else only
    the output's first token may open one (`open_ids`), or the prompt did (`inside`)."""

    def __init__(
        self,
        open_text: bytes,
        close_text: bytes,
        close_ids: list[int],
        *,
        budget: int | None = None,
        inside: bool = False,
        open_ids: Collection[int] = (),
        anywhere: bool = False,
    ):
        self.open, self.close, self.close_ids = open_text, close_text, close_ids
        self.budget, self.inside, self.anywhere = budget, inside, anywhere
        self.open_ids = frozenset(open_ids)
        self.spent = 0  # tokens generated inside the current section
        self.fresh = True  # nothing generated yet: the first token may open a section
        self._tail = b""  # the last bytes, where a marker may be split over tokens

    @property
    def over(self) -> bool:
        """The budget is spent: the close marker must come next."""
        return self.inside and self.budget is not None and self.spent >= self.budget

    def advance(self, token: int, data: bytes) -> None:
        first, self.fresh = self.fresh, False
        if self.inside:
            self.spent += 1
        elif first and token in self.open_ids:
            self.inside, self.spent = True, 0
            return
        if not self.inside and not self.anywhere:
            return
        seen = self._tail + data
        opened, closed = seen.rfind(self.open), seen.rfind(self.close)
        if closed >= 0 and closed >= opened:
            self.inside = False
        elif opened >= 0 and self.anywhere and not self.inside:
            self.inside, self.spent = True, 0
        self._tail = seen[-max(len(self.open), len(self.close)) :]


class Constraint:
    """One sequence's grammar and thinking bounds. Not thread-safe: the engine thread uses
    it, except for the mask the worker computes while the engine thread waits for the step.

    With a thinking section at the output's start, the grammar applies once it has ended
    (unless `grammar_thinks`: the grammar includes the thinking); its first token may also
    open one (`think.open_ids`)."""

    def __init__(
        self,
        matcher: llguidance.LLMatcher | None,
        vocab: Vocab,
        stop_ids: Collection[int],
        eos_ids: Collection[int] = (),
        think: Thinking | None = None,
        grammar_thinks: bool = False,
    ):
        self.matcher, self.vocab, self.think = matcher, vocab, think
        self.stop_ids = np.array(sorted(stop_ids), dtype=np.int64)
        self.eos_ids = np.array(sorted(eos_ids), dtype=np.int64)
        self.grammar_thinks = grammar_thinks
        self._started = False  # the grammar has read a token
        self._forced: list[int] = []  # tokens due next (a thinking section's close)
        self._blanks = 0  # blank tokens still allowed between the thinking and the answer

    @property
    def waiting(self) -> bool:
        """The grammar waits for the thinking section at the output's start to end."""
        t = self.think
        return t is not None and t.inside and not self._started and not self.grammar_thinks

    @property
    def finished(self) -> bool:
        """The grammar is complete and nothing but the end may follow: generation stops."""
        return self.matcher is not None and not self.waiting and self.matcher.is_stopped()

    def plan(self) -> tuple[int, ...] | str | None:
        """What this step's mask is: the one token due, the grammar's, or None (free)."""
        if not self._forced and self.think is not None and self.think.over:
            self._forced = list(self.think.close_ids)
        if self._forced:
            return (self._forced[0],)
        if self.matcher is None or self.waiting:
            return None
        return _GRAMMAR

    def adjust(self, row: np.ndarray) -> None:
        """Stop tokens end the output only where the grammar is complete (the engine's
        eos bits are the request's to set); the first token may open the thinking, and
        the answer after a thinking section may begin with a line break or two."""
        bits = row.view(np.uint8)
        _set(bits, self.eos_ids, False)
        _set(bits, self.stop_ids, self.matcher.is_accepting())
        t = self.think
        if t is not None and t.fresh and t.open_ids:
            _set(bits, np.array(sorted(t.open_ids), dtype=np.int64), True)
        if self._blanks and not self._started:
            _set(bits, self.vocab.blank_ids, True)

    def advance(self, token: int) -> None:
        """Follows a sampled token (end tokens never reach here)."""
        data = self.vocab.bytes[token] if token < self.vocab.size else b""
        if self._forced and self._forced[0] == token:
            self._forced.pop(0)
        t = self.think
        waited = self.waiting
        if t is not None:
            t.advance(token, data)
        if self.matcher is None or (waited and not self.grammar_thinks):
            self._blanks = 2 if waited and not self.waiting else 0
            return  # thinking: the grammar has not begun
        if not self._started and t is not None and t.inside and not self.grammar_thinks:
            return  # the first token opened the thinking
        if self._blanks and not self._started and data and not data.strip(b" \n"):
            self._blanks -= 1
            return  # the line break after the thinking, which the parser drops
        self._started = True
        self.matcher.consume_token(token)  # a token the mask ruled out leaves it in error


def _set(bits: np.ndarray, ids: np.ndarray, on: bool) -> None:
    ids = ids[ids < bits.size * 8]
    if on:
        np.bitwise_or.at(bits, ids >> 3, (1 << (ids & 7)).astype(np.uint8))
    else:
        np.bitwise_and.at(bits, ids >> 3, ~(1 << (ids & 7)).astype(np.uint8))


@dataclass(frozen=True, slots=True)
class Mask:
    """One row's mask: the tokens allowed (`allow`) or those ruled out, whichever are
    fewer, out of `size`."""

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


class Masks:
    """A step's masks, one per sampled row (None: free; an exception: that row's grammar
    failed, and its sequence alone ends with it)."""

    def __init__(self, rows: int, future: Future | None = None, ready: list | None = None):
        self.rows, self._future, self._ready = rows, future, ready

    def wait(self) -> list[Mask | Exception | None]:
        if self._future is None:
            return list(self._ready) if self._ready is not None else [None] * self.rows
        return self._future.result()


class Masker:
    """Computes masks off the engine thread (one worker; the engine computes its rows in
    parallel where it has cores). A row whose constraint raises gets the exception in
    place of its mask; the other rows keep theirs."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._executor: llguidance.LLExecutor | None = None

    def start(self, rows: list[Constraint | None]) -> Masks:
        """Begins computing the masks of a step's sampled rows (their constraints)."""
        plans = _plans(rows)
        if all(p is None or isinstance(p, Exception) for p in plans):
            return Masks(len(rows), ready=plans)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="freetoken-masks")
        return Masks(len(rows), self._pool.submit(self._compute, rows, plans))

    def compute(self, rows: list[Constraint | None]) -> list[Mask | Exception | None]:
        """The same masks, on the calling thread."""
        return self._compute(rows, _plans(rows))

    def _compute(
        self, rows: list[Constraint | None], plans: list[tuple[int, ...] | str | Exception | None]
    ) -> list[Mask | Exception | None]:
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        out: list[Mask | Exception | None] = list(plans)  # free rows and failures stand
        live = [i for i, p in enumerate(plans) if p is not None and not isinstance(p, Exception)]
        if not live:
            return out
        size = rows[live[0]].vocab.size
        words = (size + 31) // 32
        bits = np.zeros((len(rows), words), dtype=np.int32)
        grammar = [(rows[i].matcher, i) for i in live if plans[i] == _GRAMMAR]
        if grammar:
            try:
                self._executor.unsafe_compute_mask_ptr(
                    grammar, bits.ctypes.data, words * 4, len(rows)
                )
            except Exception:  # one matcher's fault: each row alone, so the others go on
                for one in grammar:
                    try:
                        self._executor.unsafe_compute_mask_ptr(
                            [one], bits.ctypes.data, words * 4, len(rows)
                        )
                    except Exception as e:
                        out[one[1]] = e
        for i in live:
            if isinstance(out[i], Exception):
                continue
            c, p = rows[i], plans[i]
            try:
                if p == _GRAMMAR:
                    c.adjust(bits[i])
                else:
                    _set(bits[i].view(np.uint8), np.array(p, dtype=np.int64), True)
                out[i] = Mask.of_bits(bits[i], size)
            except Exception as e:
                out[i] = e
        return out


def _plans(rows: list[Constraint | None]) -> list[tuple[int, ...] | str | Exception | None]:
    """Each row's plan (Constraint.plan), or the exception its constraint raised."""
    out: list[tuple[int, ...] | str | Exception | None] = []
    for c in rows:
        try:
            out.append(c.plan() if c is not None else None)
        except Exception as e:
            out.append(e)
    return out
