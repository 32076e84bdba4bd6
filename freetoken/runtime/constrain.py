"""Constrained decoding: token masks from a grammar's matcher states, per sequence.

`GrammarMasks` turns a matcher state into the set of tokens whose bytes keep the output a
valid prefix. Masks are cached by stack, so states that recur (inside a long string, the
same spot of each array item) cost one lookup; a new one costs a trie walk that stops at
the first byte a token cannot have, or inside free string content a vector expression plus
a walk over the tokens holding a quote or a backslash.

A `Constraint` follows one sequence: it waits for the thinking section to end when there is
one, masks each step, advances on the sampled token and says when the value is complete.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from freetoken.chat.jsonfsm import Grammar, Matcher, State
from freetoken.runtime.vocab import Vocab

__all__ = ["Constraint", "GrammarMasks", "MaskCache"]


class GrammarMasks:
    """Masks of one grammar over one vocabulary, cached by matcher stack (as bits, at most
    `budget` bytes of them: about 850 masks of a 150k vocabulary in 16 MiB)."""

    def __init__(self, grammar: Grammar, vocab: Vocab, budget: int = 16 << 20):
        self.matcher = Matcher(grammar)
        self.vocab = vocab
        self.capacity = max(64, budget // (vocab.size // 8 + 1))
        self._cache: OrderedDict[tuple, np.ndarray] = OrderedDict()  # packed bits
        self.walked = 0  # trie nodes visited (a measure of the work done)

    def mask(self, state: State) -> np.ndarray:
        """Tokens allowed next, as a new bool array [vocab.size] (end-of-text tokens are not
        in it)."""
        masks = [self._stack_mask(stack) for stack in state]
        if len(masks) == 1:
            return masks[0]
        return np.logical_or.reduce(masks)

    def _stack_mask(self, stack: tuple) -> np.ndarray:
        packed = self._cache.get(stack)
        if packed is not None:
            self._cache.move_to_end(stack)
            return np.unpackbits(packed, count=self.vocab.size).view(bool)
        mask = self._compute(stack)
        self._cache[stack] = np.packbits(mask)
        if len(self._cache) > self.capacity:
            self._cache.popitem(last=False)
        return mask

    def _compute(self, stack: tuple) -> np.ndarray:
        v, m = self.vocab, self.matcher
        ids: list[int] = []
        walk = m.step_many
        free = m.free_string(stack)
        if free is None:
            mask = np.zeros(v.size, dtype=bool)
            self.walked += v.trie.walk([stack], walk, ids)
        elif free[0] == 0:
            # inside a string: plain content by vectors, tokens that may leave it by walking
            mask = v.string_content(free[1], free[2])
            self.walked += v.string_exits.walk([stack], walk, ids)
        else:
            # after a backslash: an escape letter and plain content by vectors, then the
            # tokens that may leave the string and \uXXXX by walking
            mask = v.escaped_content(free[2])
            self.walked += v.string_exits.walk([stack], walk, ids)
            u = v.subtrie(ord("u"))
            if u is not None:
                self.walked += v.trie.walk([stack], walk, ids, u)
        if ids:
            mask[np.asarray(ids, dtype=np.int64)] = True
        return mask


class MaskCache:
    """Compiled grammars with their mask caches, the most recently used kept, so requests
    that repeat a schema (an agent's tools, an app's format) reuse what was computed."""

    def __init__(self, vocab: Vocab, grammars: int = 8):
        self.vocab = vocab
        self.limit = grammars
        self._lru: OrderedDict[str, GrammarMasks] = OrderedDict()

    def get(self, key: Any, build: Any) -> GrammarMasks:
        """The masks for `key` (any JSON value naming the grammar); `build()` makes the
        Grammar when it is not cached."""
        k = json.dumps(key)  # key order matters: properties come in the order given
        found = self._lru.get(k)
        if found is None:
            found = self._lru[k] = GrammarMasks(build(), self.vocab)
            if len(self._lru) > self.limit:
                self._lru.popitem(last=False)
        self._lru.move_to_end(k)
        return found


class Constraint:
    """One sequence's grammar. Not thread-safe: the engine thread alone uses it.

    Thinking: with `thinking` the output starts inside a thinking section and the grammar
    applies once `think_close` has been generated; `think_open_ids` are tokens that may open
    such a section as the very first token instead (a model that may think first).
    """

    def __init__(
        self,
        masks: GrammarMasks,
        end_ids: frozenset[int],
        *,
        thinking: bool = False,
        think_close: bytes | None = None,
        think_open_ids: frozenset[int] = frozenset(),
    ):
        self.masks = masks
        self.end_ids = sorted(end_ids)
        self.state = masks.matcher.initial()
        self.think_close = think_close
        self.think_open_ids = sorted(think_open_ids) if think_close else []
        self.waiting = thinking and think_close is not None  # thinking: no mask yet
        self._seen = b""  # the tail of the thinking text, to find where it ends
        self._first = True  # no token read under the grammar yet
        self._last: tuple[tuple[State, bool], torch.Tensor] | None = None

    @property
    def finished(self) -> bool:
        """The value is complete and nothing may follow: generation should stop."""
        return not self.waiting and self.masks.matcher.is_final(self.state)

    def mask(self) -> torch.Tensor | None:
        """Allowed tokens for the next step (bool [vocab]); None while unconstrained."""
        if self.waiting:
            return None
        key = (self.state, self._first)
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        allowed = self.masks.mask(self.state)  # a fresh array: free to change
        if self.masks.matcher.is_done(self.state):
            allowed[self.end_ids] = True
        if self._first:
            allowed[self.think_open_ids] = True
        mask = torch.from_numpy(allowed)
        self._last = (key, mask)
        return mask

    def advance(self, token: int) -> None:
        """Follows a sampled token (end-of-text tokens never reach here)."""
        vocab = self.masks.vocab
        data = vocab.bytes[token] if token < vocab.size else b""
        if self.waiting:
            self._watch_thinking(data)
            return
        first, self._first = self._first, False
        if first and token in self.think_open_ids:
            self.waiting = True
            return
        # a token the mask allowed always matches; keep the last good state otherwise
        self.state = self.masks.matcher.feed(self.state, data) or self.state

    def _watch_thinking(self, data: bytes) -> None:
        seen = self._seen + data
        at = seen.find(self.think_close)
        if at < 0:
            self._seen = seen[-len(self.think_close) :]
            return
        self.waiting = self._first = False
        rest = seen[at + len(self.think_close) :]
        self.state = self.masks.matcher.feed(self.state, rest) or self.state
