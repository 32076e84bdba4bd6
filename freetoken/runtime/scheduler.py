"""Step planning: which sequences run in the next step and how many tokens each feeds.

Plain Python over Sequence objects. Decoding sequences go first (one token each) so a
long prompt never starves them; the rest of the step's token budget goes to prefill
chunks. When the KV pool runs dry the most recently admitted sequence is preempted: its
pages are released and it is recomputed later.
"""

from __future__ import annotations

from collections import deque

from freetoken.runtime.kv_cache import KVCache
from freetoken.runtime.sequence import Sequence, Status

Plan = list[tuple[Sequence, int]]


class Scheduler:
    def __init__(self, kv: KVCache, max_running: int, chunk: int):
        self.kv, self.max_running, self.chunk = kv, max_running, chunk
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence from the queues and give its pages back."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
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
            n = min(seq.num_tokens - seq.num_cached, budget)
            if n <= 0 or not self._reserve(seq, n, plan):
                continue
            plan.append((seq, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            seq = self.waiting[0]
            n = min(seq.num_tokens - seq.num_cached, budget)
            if not self._reserve(seq, n, plan, preempt=False):
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            plan.append((seq, n))
            budget -= n
        return plan

    def _reserve(self, seq: Sequence, n: int, plan: Plan, preempt: bool = True) -> bool:
        need = self.kv.pages_for(seq.num_cached + n) - len(seq.pages)
        while need > self.kv.pool.num_free:
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
