"""Constrained decoding on the llguidance engine: grammars compiled against the model's
vocabulary, each sequence's constraint, and a step's masks computed while the model runs.

`Grammars` compiles a grammar (chat/grammar.py) once and keeps it, most recently used first,
so requests that repeat a schema (an agent's tools, an app's format) start from a copy.

A `Constraint` follows one sequence: a grammar that waits for the thinking section to end
when the output starts with one, and a thinking budget that forces the section's close
marker once it is spent (the format's `thinking_bounds`).

A step's masks are computed from the constraints by runtime/masks.py.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection

import llguidance
import numpy as np

from freetoken.chat.grammar import Grammar, SchemaError, explain
from freetoken.runtime.vocab import Vocab

__all__ = ["Constraint", "Grammars", "Thinking"]

GRAMMAR = "grammar"  # a row whose mask the matcher computes


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
        return GRAMMAR

    def adjust(self, bits: np.ndarray) -> None:
        """Corrects the grammar's bitmask row (uint32 words): stop tokens end the output only
        where the grammar is complete (the engine's eos bits are the request's to set); the
        first token may open the thinking, and the answer after a thinking section may begin
        with a line break or two."""
        set_bits(bits, self.eos_ids, False)
        set_bits(bits, self.stop_ids, self.matcher.is_accepting())
        t = self.think
        if t is not None and t.fresh and t.open_ids:
            set_bits(bits, np.array(sorted(t.open_ids), dtype=np.int64), True)
        if self._blanks and not self._started:
            set_bits(bits, self.vocab.blank_ids, True)

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


def set_bits(words: np.ndarray, ids: np.ndarray, on: bool) -> None:
    """Sets (on) or clears the bits of `ids` in a row of uint32 words, llguidance's layout:
    token t is bit t % 32 of word t // 32."""
    ids = ids[ids < words.size * 32]
    bit = np.left_shift(np.uint32(1), (ids & 31).astype(np.uint32))
    if on:
        np.bitwise_or.at(words, ids >> 5, bit)
    else:
        np.bitwise_and.at(words, ids >> 5, ~bit)
