from __future__ import annotations

import random

import pytest
import torch

from freetoken.models.base import KVLayout
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


def test_sparse_and_compressed_layers_get_their_rows():
    """An indexer key beside each latent; a compressed layer's entries after its token rows
    (four per page at ratio 2, one per page at ratio 16) and a spare row; sized so."""
    layout = [
        KVLayout.latent(6, index_dim=3),
        KVLayout.compressed(8, window=4, ratio=2, inputs_dim=5, index_dim=2),
        KVLayout.compressed(8, window=4, ratio=16, inputs_dim=4),
    ]
    kv = KVCache(layout, 3, 8, torch.float32, torch.device("cpu"))
    assert [tuple(t.shape) for t in kv.k] == [(24, 1, 6), (24 + 12 + 1, 1, 8), (24 + 3 + 1, 1, 8)]
    assert kv.index[0].shape == (24, 1, 3) and kv.index[1].shape == (37, 1, 2)
    assert kv.index[2] is None and kv.inputs[0] is None
    assert kv.inputs[1].shape == (24, 1, 5) and kv.inputs[2].shape == (24, 1, 4)
    assert kv.entry_row(1, 2) == 24 + 8 and kv.entry_row(2, 2) == 24 + 2
    page = KVCache.page_bytes(layout, torch.float32, 8)
    assert page * 3 + 4 * (8 + 2) + 4 * 8 == kv.bytes  # the spare rows are not paged
    with pytest.raises(ValueError, match="tile"):
        KVCache([KVLayout.compressed(8, 4, 3, 5)], 2, 8, torch.float32, torch.device("cpu"))


def test_copying_a_page_copies_its_entries_whole():
    layout = [KVLayout.compressed(4, window=4, ratio=2, inputs_dim=3, index_dim=2)]
    kv = KVCache(layout, 3, 4, torch.float32, torch.device("cpu"))
    for t in (kv.k[0], kv.index[0], kv.inputs[0]):
        t.copy_(torch.randn(t.shape))
    kv.copy_page(1, 2, 3)
    for t in (kv.k[0], kv.index[0], kv.inputs[0]):
        assert torch.equal(t[8:11], t[4:7]) and not torch.equal(t[11], t[7])
    e1, e2 = kv.entry_row(0, 1), kv.entry_row(0, 2)
    assert torch.equal(kv.k[0][e2 : e2 + 2], kv.k[0][e1 : e1 + 2])
    assert torch.equal(kv.index[0][e2 : e2 + 2], kv.index[0][e1 : e1 + 2])


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
