"""Resizing the expert cache: bookkeeping across resizes, and unchanged results (CPU emulation)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from freetoken.moe.cache import ExpertCache
from tests import fixtures
from tests.moe.test_cache import _check_invariants
from tests.runtime.engine_util import full_logits, generate, make_engine

PROMPT = [5, 17, 99, 3, 250, 11, 7, 300, 42, 128]

F32 = {"gate_up": torch.float32, "down": torch.float32}  # each bank's slot dtype


def test_bookkeeping_invariants_across_random_resizes():
    rng = random.Random(0)
    L, E, k = 4, 16, 4
    c = ExpertCache(L, E, 24, {"gate_up": (3,), "down": (2,)}, F32, torch.device("cpu"))

    # each slot's content names its expert, so a wrong move is visible
    def stamp(slots, layer, experts):
        for s, e in zip(slots.tolist(), experts.tolist()):
            c.slots["gate_up"][s] = layer * E + e
            c.slots["down"][s] = layer * E + e

    for step in range(2000):
        layer = step % L
        experts = np.array(sorted(rng.sample(range(E), k)))
        slots = c.lookup(layer, experts)
        miss = experts[slots < 0]
        if len(miss):
            new = c.allocate(layer, miss, slots[slots >= 0])
            stamp(new, layer, miss)
            slots[np.isin(experts, miss)] = new
        c.touch(slots)
        if step % 50 == 49:
            before = {int(o): int(c.last_use[s]) for s, o in enumerate(c.owner) if o >= 0}
            cap = rng.randrange(4, 40)
            kept = c.resize(cap)
            _check_invariants(c)
            assert c.capacity == cap and kept == int((c.owner >= 0).sum()) <= cap
            # the most recently used experts are the ones kept, with their bytes
            expect = sorted(before, key=lambda o: -before[o])[:cap]
            assert set(c.owner[c.owner >= 0].tolist()) == set(expect)
            for s, o in enumerate(c.owner.tolist()):
                if o >= 0:
                    assert (
                        float(c.slots["gate_up"][s][0]) == o and float(c.slots["down"][s][0]) == o
                    )


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize(
    "policy,start,sizes",
    [("adaptive", 9, [16, 8, 12]), ("lru-pcie", 20, [8, 20]), ("static-layers", 16, [8, 16])],
)
def test_results_are_identical_across_resizes(tiny_model, policy, start, sizes, device):
    path, hf = tiny_model
    engine = make_engine(path, policy=policy, slots=start, device=device)
    backend = engine.model.model.layers[0].mlp.experts.backend
    ref = full_logits(engine, PROMPT)
    expected = fixtures.hf_greedy(hf, PROMPT, 12)
    for size in sizes:
        backend.resize(size)
        assert (
            torch.equal(full_logits(engine, PROMPT), ref)
            or float((full_logits(engine, PROMPT) - ref).norm() / ref.norm()) <= 1e-6
        )
        (seq,) = generate(engine, [PROMPT], 12)
        assert seq.output_ids == expected
        assert backend.cache.capacity == min(size, 16)  # never more slots than experts


def test_a_size_below_the_floor_is_refused_and_changes_nothing(tiny_model):
    path, _ = tiny_model
    engine = make_engine(path, policy="adaptive", slots=12)
    backend = engine.model.model.layers[0].mlp.experts.backend
    generate(engine, [PROMPT], 4)
    owners = backend.cache.owner.copy()
    with pytest.raises(ValueError, match="below the floor of 8"):
        backend.resize(5)
    assert backend.cache.capacity == 12 and (backend.cache.owner == owners).all()
    resident = make_engine(path, policy="resident", slots=16)
    with pytest.raises(ValueError, match="resident policy needs all 16"):
        resident.model.model.layers[0].mlp.experts.backend.resize(12)
