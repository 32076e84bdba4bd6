from __future__ import annotations

import random

import pytest
import torch

from freetoken.runtime.kv_cache import KVCache, OutOfPages, PagePool
from freetoken.runtime.sampling import SamplingParams
from freetoken.runtime.scheduler import Scheduler
from freetoken.runtime.sequence import Sequence


def test_page_pool_refcounts():
    pool = PagePool(4)
    a = pool.alloc(3)
    pool.share(a[:1])
    pool.release(a)
    assert pool.num_free == 3  # the shared page is still held once
    pool.release(a[:1])
    assert pool.num_free == 4
    with pytest.raises(ValueError):
        pool.release(a[:1])
    with pytest.raises(OutOfPages):
        pool.alloc(5)


def test_slots_follow_the_page_table():
    kv = KVCache.uniform(1, 8, 4, 1, 2, torch.float32, torch.device("cpu"))
    slots = kv.slots_of([5, 2, 7], 2, 10, torch.device("cpu"))
    assert slots.tolist() == [22, 23, 8, 9, 10, 11, 28, 29]


def _seq(n_prompt: int) -> Sequence:
    return Sequence(list(range(n_prompt)), SamplingParams(), 1000, frozenset())


def test_scheduler_invariants_under_random_load():
    """Pages are never shared by two sequences, never leak, and every plan fits the budget."""
    rng = random.Random(0)
    kv = KVCache.uniform(1, 24, 4, 1, 2, torch.float32, torch.device("cpu"))
    sched = Scheduler(kv, max_running=3, chunk=10)
    live: list[Sequence] = []
    for _ in range(400):
        if rng.random() < 0.3:
            s = _seq(rng.randrange(1, 30))
            sched.add(s)
            live.append(s)
        plan = sched.schedule()
        assert sum(n for _, n in plan) <= 10
        owners: dict[int, int] = {}
        for s in sched.running:
            assert len(s.pages) >= kv.pages_for(s.num_cached)
            for p in s.pages:
                assert p not in owners, "a page is held by two sequences"
                owners[p] = s.id
        assert len(owners) + kv.pool.num_free == kv.pool.num_pages
        for s, n in plan:
            assert len(s.pages) >= kv.pages_for(s.num_cached + n)
            s.num_cached += n
            if s.num_cached == s.num_tokens:
                s.output_ids.append(0)  # a sampled token
        for s in list(live):
            if len(s.output_ids) > rng.randrange(1, 12):
                sched.remove(s)
                live.remove(s)
    for s in live:
        sched.remove(s)
    assert kv.pool.num_free == kv.pool.num_pages
