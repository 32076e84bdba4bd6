"""Every policy gives the logits of the fully resident model (CPU emulation of the slot pool)."""

from __future__ import annotations

import pytest

from tests import fixtures
from tests.runtime.engine_util import full_logits, generate, make_engine

PROMPT = [5, 17, 99, 3, 250, 11, 7, 300, 42, 128]
CASES = [
    ("resident", 16),
    ("lru-pcie", 9),
    ("cpu-misses", 9),
    ("static-layers", 8),
    ("adaptive", 9),
    ("adaptive", 0),
]


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def reference(tiny_model):
    path, hf = tiny_model
    return full_logits(make_engine(path, policy="resident", slots=16), PROMPT)


@pytest.mark.parametrize("policy,slots", CASES)
def test_policy_logits_match_resident(tiny_model, reference, policy, slots):
    path, _ = tiny_model
    engine = make_engine(path, policy=policy, slots=slots)
    assert _rel(full_logits(engine, PROMPT), reference) <= 1e-5


@pytest.mark.parametrize("policy,slots", CASES)
def test_policy_greedy_decode_matches_transformers(tiny_model, policy, slots):
    path, hf = tiny_model
    engine = make_engine(path, policy=policy, slots=slots)
    (seq,) = generate(engine, [PROMPT], 24)
    assert seq.output_ids == fixtures.hf_greedy(hf, PROMPT, 24)
    stats = engine.model.model.layers[0].mlp.experts.backend.stats()
    if policy == "cpu-misses":
        assert stats["q"] == 0 and stats["cpu_routes"] > 0
    if policy == "lru-pcie":
        assert stats["q"] == stats["m"] and stats["cpu_routes"] == 0
    if policy == "static-layers":
        assert stats["cpu_layers"] == [0]  # 8 slots hold one of the two layers
        # the CPU layer's misses are the cache's, the fixed layer's routes its hits
        cache = stats["cache"]
        assert cache["misses"] == stats["m"] > 0 and cache["hits"] > 0
    if policy == "resident":
        assert stats["cache"]["misses"] == 0


def test_adaptive_uses_both_paths_on_a_small_cache(tiny_model):
    path, hf = tiny_model
    engine = make_engine(path, policy="adaptive", slots=9)
    backend = engine.model.model.layers[0].mlp.experts.backend
    from freetoken.moe.dispatch import PathCost

    backend.split.pcie, backend.split.cpu = (
        PathCost(1e-3),
        PathCost(1e-3),
    )  # equal: split misses evenly
    (seq,) = generate(engine, [PROMPT], 24)
    s = backend.stats()
    assert 0 < s["q"] < s["m"] and s["cpu_routes"] > 0
    assert seq.output_ids == fixtures.hf_greedy(hf, PROMPT, 24)


def test_resident_needs_room_for_every_expert(tiny_model):
    path, _ = tiny_model
    with pytest.raises(ValueError, match="resident policy needs 16 expert slots"):
        make_engine(path, policy="resident", slots=9)


def test_adaptive_switching_placements_keeps_the_model_exact(tiny_model, monkeypatch):
    """Adaptive moves between the cache and whole CPU layers while decoding; the tokens stay
    those of transformers whichever placement each step runs in."""
    from freetoken.moe import tuning
    from freetoken.moe.chooser import ModeChooser

    monkeypatch.setattr(
        tuning,
        "ModeChooser",
        lambda **kw: ModeChooser(settle=1, measure=2, period=6, **kw),
    )
    # measuring from the first step, every placement in turn
    monkeypatch.setattr(tuning, "EXPLORE_AFTER", 0)
    monkeypatch.setattr(tuning, "DUTY", 1.0)
    path, hf = tiny_model
    engine = make_engine(path, policy="adaptive", slots=9)
    backend = engine.model.model.layers[0].mlp.experts.backend
    seen = []
    step = backend.between_steps
    backend.between_steps = lambda tokens: (
        step(tokens),
        seen.append((backend.placement.mode, sorted(backend.placement.cpu_layers))),
    )
    (seq,) = generate(engine, [PROMPT], 40)
    assert seq.output_ids == fixtures.hf_greedy(hf, PROMPT, 40)
    assert ("layers", [0]) in seen and ("cache", []) in seen  # 9 slots fit one layer of 8 experts
    assert backend.stats()["placement"]["step_ms"].keys() == {"cache", "layers"}
    # settled on whole layers, a long prompt still prefills through the cache, then decode goes back
    chooser = ModeChooser(settle=0, measure=1, period=10**9)
    chooser.observe(0.05)
    chooser.observe(0.01)
    assert chooser.mode == "layers"
    backend.tuner.modes = chooser
    long_prompt = [(13 * i) % 500 + 1 for i in range(48)]
    seen.clear()
    (seq,) = generate(engine, [long_prompt], 8)
    assert seen[0] == ("cache", []) and seen[-1] == ("layers", [0])
    assert seq.output_ids == fixtures.hf_greedy(hf, long_prompt, 8)


def test_a_layers_visit_gives_the_cache_back_as_it_held_it(tiny_model):
    """Whole layers on the CPU empty their slots for the fixed ones; back in the cache, each
    layer holds the experts it held before (the CPU layers none otherwise, which a split
    computing its misses on the CPU never refilled), each slot with its expert's bytes."""
    import torch

    from freetoken.moe.cache import expert_part
    from freetoken.moe.hotset import resident
    from freetoken.moe.policy import Mode

    path, hf = tiny_model
    engine = make_engine(path, policy="adaptive", slots=9)
    generate(engine, [PROMPT], 6)
    backend = engine.model.model.layers[0].mlp.experts.backend
    cache, layers = backend.cache, list(backend.banks.layers)
    before = {layer: sorted(e) for layer, e in resident(cache, layers).items()}
    assert len(before) == 2  # both layers hold some of their experts
    backend._switch(Mode.LAYERS)
    assert backend.placement.cpu_layers == {0} and 0 not in resident(cache, layers)
    backend._switch(Mode.CACHE)
    after = resident(cache, layers)
    assert {layer: sorted(e) for layer, e in after.items()} == before
    for layer, experts in after.items():
        for e in experts:
            for bank, src in backend.banks.banks[layer].items():
                got = expert_part(cache.slots[bank], int(cache.slot_of[layer, e]), src[e])
                assert torch.equal(got.cpu(), src[e].cpu())
    (seq,) = generate(engine, [PROMPT], 12)
    assert seq.output_ids == fixtures.hf_greedy(hf, PROMPT, 12)


@pytest.mark.parametrize("policy", ["adaptive", "lru-pcie", "cpu-misses"])
def test_a_pool_holding_every_expert_routes_like_resident(tiny_model, policy):
    """Nothing can miss when the cache holds every expert: every layer is fixed in its
    slots and routed on the device with no books (one graph a step on a GPU, no books
    kernel nor fetch a layer); a resize below that gives the layers back to the cache."""
    path, hf = tiny_model
    engine = make_engine(path, policy=policy, slots=16, device_cache="on")
    backend = engine.model.model.layers[0].mlp.experts.backend
    layers = engine.model.moe_layers
    assert backend.placement.fixed_layers == set(layers)
    assert all(backend.device_only(layer, t) for layer in layers for t in (1, 2))
    (seq,) = generate(engine, [PROMPT], 16)
    assert seq.output_ids == fixtures.hf_greedy(hf, PROMPT, 16)
    stats = backend.stats()
    assert stats["cache"]["misses"] == 0 and stats["cache"]["hits"] > 0 and stats["m"] == 0
    backend.resize(12)
    assert not backend.placement.fixed_layers and not backend.cache.fixed.any()
    (seq,) = generate(engine, [PROMPT], 16)
    assert seq.output_ids == fixtures.hf_greedy(hf, PROMPT, 16)
    assert backend.stats()["cache"]["misses"] > 0
    backend.resize(16)  # grown back: fixed again, the cached experts kept in their slots
    assert backend.placement.fixed_layers == set(layers) and backend.cache.fixed.all()
    (seq,) = generate(engine, [PROMPT], 8)
    assert seq.output_ids == fixtures.hf_greedy(hf, PROMPT, 8)


@pytest.mark.parametrize("near_uniform, settles_in", [(1e9, "device"), (0.0, "predicted")])
def test_adaptive_starts_in_device_and_judges_the_routings_locality(
    tiny_model, monkeypatch, near_uniform, settles_in
):
    """With nothing learned, the first answer starts in device (every miss kept); after a few
    decode steps it moves to the bandwidths' prediction only where the misses came near what
    uniform routing gives, and the tokens stay those of transformers throughout."""
    from freetoken.moe import locality

    monkeypatch.setattr(locality, "LOCALITY_STEPS", 4)
    monkeypatch.setattr(locality, "NEAR_UNIFORM", near_uniform)
    path, hf = tiny_model
    engine = make_engine(path, policy="adaptive", slots=9, device_cache="on")
    backend = engine.model.model.layers[0].mlp.experts.backend
    check = backend.tuner.locality
    assert backend.tuner.modes.mode == "device" and check.predicted != "device"
    assert 0 < check.cost_ratio < 1  # the prediction is cheaper a miss, or it would be device
    check.cost_ratio = near_uniform  # the other way to the prediction, held with NEAR_UNIFORM
    (seq,) = generate(engine, [PROMPT], 16)
    assert seq.output_ids == fixtures.hf_greedy(hf, PROMPT, 16)
    assert backend.tuner.locality is None  # judged once
    want = "device" if settles_in == "device" else check.predicted
    assert backend.tuner.modes.mode == want and backend.placement.mode == want


def test_a_warmed_cache_is_already_in_the_first_answers_placement(tiny_model):
    """The load warms the cache and then captures decode graphs: in the placement the first
    decode step asks for, so that step moves nothing and keeps the graphs (a move there
    dropped them all, and the first answer captured them again)."""
    path, hf = tiny_model
    engine = make_engine(path, policy="adaptive", slots=9, device_cache="on")
    backend = engine.model.model.layers[0].mlp.experts.backend
    assert backend.tuner.modes.mode == "device" and backend.placement.mode == "cache"
    backend.warm()
    assert backend.placement.mode == "device"
    seen = []
    step = backend.between_steps
    backend.between_steps = lambda tokens: (
        step(tokens),
        seen.append((backend.generation, backend.variant)),
    )
    (seq,) = generate(engine, [PROMPT], 8)
    assert seq.output_ids == fixtures.hf_greedy(hf, PROMPT, 8)
    assert len(set(seen)) == 1  # no step moved the placement


@pytest.mark.parametrize("min_gain, visits", [(1e9, False), (0.0, True)])
def test_adaptive_measures_only_where_its_misses_leave_something_to_gain(
    tiny_model, monkeypatch, min_gain, visits
):
    """The chooser asks the decode steps' misses whether a measurement could gain: with no
    gain enough, it serves on in device and visits nothing; the tokens stay exact."""
    from freetoken.moe import locality, tuning

    never = 10**6  # the locality check still pending: device serves
    monkeypatch.setattr(locality, "LOCALITY_STEPS", never)
    monkeypatch.setattr(locality, "EARLY_STEPS", never)
    monkeypatch.setattr(tuning, "EXPLORE_AFTER", 4)
    monkeypatch.setattr(tuning, "DUTY", 1.0)
    monkeypatch.setattr(tuning, "WINDOW_STEPS", 4)
    # a tiny model's four-step windows miss 0 to a dozen times: any window after the first
    # counts here (the settling rule has tests of its own)
    monkeypatch.setattr(tuning, "SETTLED", float("inf"))
    monkeypatch.setattr(tuning, "MIN_GAIN", min_gain)
    monkeypatch.setattr(tuning, "SPLIT_GAIN", min_gain)
    monkeypatch.setattr(tuning.ModeChooser, "GATE_RETRY", 4)
    path, hf = tiny_model
    engine = make_engine(path, policy="adaptive", slots=9, device_cache="on")
    backend = engine.model.model.layers[0].mlp.experts.backend
    chooser = backend.tuner.modes
    assert chooser.prospects is backend.tuner.window is not None
    placements = set()
    step = backend.between_steps
    backend.between_steps = lambda tokens: (step(tokens), placements.add(backend.placement.mode))
    (seq,) = generate(engine, [PROMPT], 40)
    assert seq.output_ids == fixtures.hf_greedy(hf, PROMPT, 40)
    assert bool(placements & {"split", "layers"}) is visits
    assert (chooser.skipped > 0) is not visits
