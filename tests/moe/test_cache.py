"""Expert-cache bookkeeping against a plain-Python LRU, under long random routing streams."""

from __future__ import annotations

import random
from collections import OrderedDict

import numpy as np
import pytest
import torch

from freetoken.moe.cache import CacheFull, ExpertCache

F32 = {"gate_up": torch.float32, "down": torch.float32}  # each bank's slot dtype


class ReferenceLRU:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self.order: OrderedDict[tuple[int, int], None] = OrderedDict()

    def step(self, layer: int, experts: list[int], fetch: list[int]) -> None:
        for e in fetch:
            while len(self.order) >= self.capacity:
                # the least recently used entry that this step does not read
                victim = next(k for k in self.order if not (k[0] == layer and k[1] in experts))
                del self.order[victim]
            self.order[(layer, e)] = None
        for e in experts:  # everything the step used becomes most recent, in expert order
            if (layer, e) in self.order:
                self.order.move_to_end((layer, e))


def _check_invariants(c: ExpertCache) -> None:
    owned = c.owner[c.owner >= 0]
    assert len(set(owned.tolist())) == len(owned), "a slot pair holds the same expert twice"
    for s, o in enumerate(c.owner.tolist()):
        if o >= 0:
            assert c.slot_of[o // c.E, o % c.E] == s
    ls, es = np.nonzero(c.slot_of >= 0)
    assert len(ls) == len(owned)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_reference_lru(seed):
    rng = random.Random(seed)
    L, E, cap, k = 4, 16, 20, 4
    c = ExpertCache(L, E, cap, {"gate_up": (2,), "down": (1,)}, F32, torch.device("cpu"))
    ref = ReferenceLRU(cap)
    lookups = 0
    for step in range(3000):
        layer = step % L
        experts = np.array(sorted(rng.sample(range(E), k)))
        slots = c.lookup(layer, experts)
        lookups += k
        miss = experts[slots < 0]
        fetch = miss[: rng.randint(0, len(miss))]  # some misses fetched, the rest "on the CPU"
        if len(fetch):
            new = c.allocate(layer, fetch, slots[slots >= 0])
            assert not set(new.tolist()) & set(slots[slots >= 0].tolist()), "evicted a slot in use"
            slots[np.isin(experts, fetch)] = new
        c.touch(slots)
        ref.step(layer, experts.tolist(), fetch.tolist())
        assert {(o // E, o % E) for o in c.owner[c.owner >= 0].tolist()} == set(ref.order)
        if step % 97 == 0:
            _check_invariants(c)
    s = c.stats()
    assert s["hits"] + s["misses"] == lookups
    assert s["fetches"] == int(c.fetches.sum()) and s["used"] <= cap


def test_fixed_slots_are_never_evicted_and_overflow_is_an_error():
    c = ExpertCache(2, 8, 10, {"gate_up": (2,)}, F32, torch.device("cpu"))
    fixed = c.fix(0, np.arange(8))
    for step in range(50):
        experts = np.array([step % 8, (step + 3) % 8])
        slots = c.lookup(1, experts)
        miss = experts[slots < 0]
        if len(miss):
            c.allocate(1, miss, slots)
    assert (c.slot_of[0] == fixed).all()
    with pytest.raises(CacheFull):
        c.allocate(1, np.arange(3), np.empty(0, dtype=np.int64))


def test_keep_frees_every_slot_but_those_named():
    c = ExpertCache(2, 8, 10, {"gate_up": (2,)}, F32, torch.device("cpu"))
    c.fix(0, np.arange(6))
    c.allocate(1, np.arange(4), np.empty(0, dtype=np.int64))
    c.keep({0: [1, 4], 1: [3]})
    assert sorted(map(tuple, np.argwhere(c.slot_of >= 0).tolist())) == [(0, 1), (0, 4), (1, 3)]
    assert int((c.owner < 0).sum()) == 7 and not c.fixed[c.owner < 0].any()
    _check_invariants(c)
    # the freed slots are the first taken: nothing kept is evicted while they last
    c.allocate(1, np.array([5, 6, 7]), np.empty(0, dtype=np.int64))
    assert (c.slot_of[0, [1, 4]] >= 0).all() and c.slot_of[1, 3] >= 0
