"""Step planning: which sequences run in the next step and how many tokens each feeds.

Plain Python over Sequence objects. Decoding sequences go first (one token each) so a
long prompt never starves them; the rest of the step's token budget goes to prefill
chunks. A sequence admitted takes what the prefix cache holds of its tokens first. When
the KV pool runs dry, pages only the prefix cache holds are evicted; then the most recently
admitted sequence is preempted: its pages are released and it is recomputed later (from
the prefix cache, which by then holds its full pages).

A model with recurrent layers also gives each running sequence a state slot
(runtime/state_cache.py), taken at admission and given back with its pages. Such a
sequence starts from the prefix cache only at an anchor (runtime/anchors.py): a saved
state whose tokens start it, the pages before it from the trie; a prefill chunk ends at
each position whose state it should leave as an anchor.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from freetoken.runtime.anchors import AnchorStore
from freetoken.runtime.kv_cache import KVCache
from freetoken.runtime.prefix_cache import Match, PrefixCache
from freetoken.runtime.sequence import Sequence, Status
from freetoken.runtime.state_cache import StateCache

Plan = list[tuple[Sequence, int]]


class Scheduler:
    """`prefix`: the prefix cache over `kv`'s pages (None: every prompt is computed whole);
    `on_match(seq, match)` hears what it found for each sequence admitted; `state`: the
    recurrent state slots (None: the model keeps none)."""

    def __init__(
        self,
        kv: KVCache,
        max_running: int,
        chunk: int,
        prefix: PrefixCache | None = None,
        on_match: Callable[[Sequence, Match], None] | None = None,
        state: StateCache | None = None,
        anchors: AnchorStore | None = None,
    ):
        self.kv, self.max_running, self.chunk = kv, max_running, chunk
        self.prefix, self.on_match, self.state = prefix, on_match, state
        self.anchors = anchors
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence from the queues and give its pages back (what it computed stays
        in the prefix cache)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if self.prefix is not None and seq.num_cached:
            computed = seq.tokens[: seq.num_cached]
            self.prefix.insert_tail(computed, seq.pages, seq.trie_node)
        self._release(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Plan:
        plan: Plan = []
        budget = self.chunk
        for seq in sorted(self.running, key=lambda s: s.num_tokens - s.num_cached):
            if budget <= 0:
                break
            if seq.status is not Status.RUNNING:
                continue  # preempted by an earlier sequence of this loop: it waits now
            n = self._chunk(seq, budget)
            if n <= 0 or not self._reserve(seq, n, plan):
                continue
            plan.append((seq, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            if self.state is not None and not self.state.num_free:
                break
            seq = self.waiting[0]
            if not seq.pages:
                self._reuse(seq)
            n = self._chunk(seq, budget)
            if not self._reserve(seq, n, plan, preempt=False):
                break
            self.waiting.popleft()
            if self.state is not None:
                seq.state_slot, seq.resume = self.state.alloc(seq.resume), None
            seq.status = Status.RUNNING
            self.running.append(seq)
            plan.append((seq, n))
            budget -= n
        return plan

    def reserve(self, seq: Sequence, n: int) -> bool:
        """Pages for `n` more tokens of a running sequence, preempting none."""
        return self._reserve(seq, n, [], preempt=False)

    def make_room(self, pages: int) -> bool:
        """Whether `pages` pages are free, after evicting what only the prefix cache holds."""
        free = self.kv.pool.num_free
        if pages > free and self.prefix is not None:
            self.prefix.evict(pages - free)
        return pages <= self.kv.pool.num_free

    def cache_pages(self, seq: Sequence) -> None:
        """Enters the sequence's newly filled pages into the prefix cache (after a step)."""
        if self.prefix is None or seq.num_cached // self.kv.page_size <= seq.trie_pages:
            return
        computed = seq.tokens[: seq.num_cached]
        seq.trie_node = self.prefix.insert(computed, seq.pages, seq.trie_node, seq.trie_pages)
        seq.trie_pages = seq.num_cached // self.kv.page_size

    @staticmethod
    def _chunk(seq: Sequence, budget: int) -> int:
        """Tokens the sequence feeds this step: up to the budget, ending at an anchor."""
        n = min(seq.num_tokens - seq.num_cached, budget)
        for at in seq.anchor_at:
            if seq.num_cached < at < seq.num_cached + n:
                n = at - seq.num_cached
        return n

    def _reuse(self, seq: Sequence) -> None:
        """Starts the sequence from what the prefix cache holds of it; its last token is
        always computed, for the logits it is sampled from. A sequence with recurrent
        state starts at the longest anchor inside that."""
        if self.prefix is None or not seq.reuse:
            return
        limit = seq.num_tokens - 1
        if self.state is not None:
            if self.anchors is None:
                return
            held = self.prefix.match(seq.tokens, limit).tokens(self.kv.page_size)
            anchor = self.anchors.find(seq.tokens, held)
            if anchor is None:
                return
            limit = len(anchor.tokens)
        pages, cached, found = self.prefix.acquire(seq.tokens, limit)
        if self.state is not None:
            if cached < limit:  # no room for the partial page: start from nothing
                self.kv.pool.release(pages)
                return
            seq.resume = anchor.state
        seq.pages, seq.num_cached, seq.cached_tokens = pages, cached, cached
        seq.trie_node, seq.trie_pages = found.node, len(found.pages)
        if self.on_match is not None:
            self.on_match(seq, found)

    def _reserve(self, seq: Sequence, n: int, plan: Plan, preempt: bool = True) -> bool:
        need = self.kv.pages_for(seq.num_cached + n) - len(seq.pages)
        while not self.make_room(need):
            victim = self._victim(seq, plan) if preempt else None
            if victim is None:
                return False
            self._preempt(victim)
        if need > 0:
            seq.pages.extend(self.kv.pool.alloc(need))
        return True

    def _victim(self, keep: Sequence, plan: Plan) -> Sequence | None:
        planned = {id(s) for s, _ in plan}
        for seq in reversed(self.running):
            if seq is not keep and id(seq) not in planned:
                return seq
        return None

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.num_cached = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def _release(self, seq: Sequence) -> None:
        if seq.pages:
            self.kv.pool.release(seq.pages)
            seq.pages = []
        seq.trie_node, seq.trie_pages = None, 0
        if seq.state_slot is not None:
            self.state.free(seq.state_slot)
            seq.state_slot = None
