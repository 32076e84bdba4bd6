"""What adaptive learned, kept across loads: saved when a measurement completes, and a later
backend over the same experts and cache size starts from it."""

from __future__ import annotations

from freetoken.moe.learned import Learned
from freetoken.moe.policy import Mode
from tests.runtime.engine_util import generate, make_engine


def test_saved_per_cache_size(tmp_path):
    store = Learned(tmp_path, "48x128x9437184-r1")
    assert store.load(100) is None
    store.save(100, {"mode": "split", "share": 0.5, "step_ms": {"split": 20.0}, "batch": 1})
    assert store.load(100)["mode"] == "split" and store.load(200) is None
    # measured before the modes were compared at one batch size: not trusted
    store.save(300, {"mode": "layers", "share": 0.5, "step_ms": {"layers": 20.0}})
    assert store.load(300) is None
    store.path(100).write_text("{not json")
    assert store.load(100) is None
    # the modes that sit out: kept where well formed, dropped where not (the load goes on)
    kept = {"mode": "split", "share": 0.5, "step_ms": {}, "batch": 0}
    store.save(100, kept | {"sitting_out": {"device": 3}})
    assert store.load(100)["sitting_out"] == {"device": 3}
    for bad in (["device"], {"device": "3"}, {"device": -1}, None):
        store.save(100, kept | {"sitting_out": bad})
        assert store.load(100)["sitting_out"] == {}
    # the batch sizes served in a mode of their own, likewise
    store.save(100, kept | {"by_batch": {4: "device"}})  # JSON makes the key a string
    assert store.load(100)["by_batch"] == {4: "device"}
    for bad in ({"four": "device"}, {"0": "device"}, {"4": 1}, ["device"]):
        store.save(100, kept | {"by_batch": bad})
        assert store.load(100)["by_batch"] == {}


def test_forgotten_for_every_model_on_this_machine(tmp_path, monkeypatch):
    """A benchmark that measures a first load drops what loads before it learned here;
    another machine's (a shared cache directory) is left alone."""
    from freetoken.moe import learned, profile

    saved = {"mode": "split", "share": 0.5, "step_ms": {}, "batch": 1}
    monkeypatch.setattr(profile, "machine_key", lambda: "other-machine")
    Learned(tmp_path, "12x128x9437184-r1").save(100, saved)
    monkeypatch.setattr(profile, "machine_key", lambda: "this-machine")
    assert not learned.forget(tmp_path)  # nothing learned here yet
    for shape in ("12x128x9437184-r1", "48x128x9437184-r1"):
        Learned(tmp_path, shape).save(100, saved)
    assert learned.forget(tmp_path)
    assert Learned(tmp_path, "48x128x9437184-r1").load(100) is None
    assert not learned.forget(tmp_path)
    monkeypatch.setattr(profile, "machine_key", lambda: "other-machine")
    assert Learned(tmp_path, "12x128x9437184-r1").load(100)["mode"] == "split"


def test_kept_apart_for_each_setting_of_the_lane(tmp_path, monkeypatch):
    """A placement measured with another part of the lane's team, another thread count or
    the workers giving way is not this load's: each keeps its own."""
    from types import SimpleNamespace

    from freetoken import config
    from freetoken.moe import setup

    placement = setup.Placement("adaptive", 0, cache_dir=tmp_path)
    host = SimpleNamespace(layers=range(48), num_experts=128, expert_bytes=9437184)
    saved = {"mode": "layers", "share": 0.5, "step_ms": {"layers": 13.3}, "batch": 1}

    def store(**env):
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        config.current.cache_clear()
        return setup._learned(placement, host, 1)

    store(FREETOKEN_LANE_TEAMS="0.5").save(100, saved)
    assert store().load(100)["mode"] == "layers"  # the same settings read it back
    assert store(FREETOKEN_LANE_TEAMS="1").load(100) is None
    assert store(FREETOKEN_LANE_TEAMS="0.5", FREETOKEN_CPU_THREADS="8").load(100) is None
    assert store(FREETOKEN_CPU_THREADS="0", FREETOKEN_LANE_GIVE_WAY="1").load(100) is None
    monkeypatch.delenv("FREETOKEN_LANE_GIVE_WAY")
    assert store().load(100)["mode"] == "layers"
    config.current.cache_clear()


def test_a_later_load_serves_each_batch_size_from_the_mode_kept_for_it(tmp_path):
    from freetoken.moe import tuning

    store = Learned(tmp_path, "12x128x9437184-r1")
    first = tuning.AdaptiveTuner(0.5, (Mode.DEVICE, Mode.SPLIT))
    first.modes.adopt("split")  # as if measured: split at one stream, device kept at four
    first.modes.serve_at({4: "device"})
    store.save(1152, first.learned() | {"batch": 1})
    again = tuning.AdaptiveTuner(0.5, None)
    shape, costs = (12, 128, 1152), (2e-4, 1e-4)
    again.choose((Mode.DEVICE, Mode.SPLIT), store.load(1152), shape, costs, lambda: (0, 0), True)
    assert again.wanted(1, Mode.DEVICE) == Mode.SPLIT
    assert again.wanted(4, Mode.SPLIT) == Mode.DEVICE


def test_a_later_load_starts_from_the_share_and_team_kept():
    """The share and the part of the lane's team tuned last time serve first; where none
    was kept (or kept damaged), the bandwidths' share and the whole team."""
    from freetoken.moe import tuning

    first = tuning.AdaptiveTuner(0.25, None, (1.0, 0.5), prior_team=0.5)
    kept = first.learned()
    assert (kept["share"], kept["team"]) == (0.25, 0.5)
    costs = (1e-4, 3e-4)  # over PCIe three times as fast: ¾ of the misses fetched
    again = tuning.AdaptiveTuner.starting(kept, costs, (1.0, 0.5))
    assert (again.share, again.team(Mode.SPLIT)) == (0.25, 0.5)
    assert again.team(Mode.LAYERS) == again.team(Mode.DEVICE) == 1.0  # the share not tuned
    for known in (None, {"mode": "split"}, {"share": "half", "team": None}):
        fresh = tuning.AdaptiveTuner.starting(known, costs, (1.0, 0.5))
        assert (fresh.share, fresh.team(Mode.SPLIT)) == (0.75, 1.0)
    alone = tuning.AdaptiveTuner.starting(kept, costs, (1.0,))  # a lane of one core
    assert (alone.share, alone.team(Mode.SPLIT)) == (0.25, 1.0)


def test_a_new_backend_starts_where_the_last_one_settled(tiny_model, tmp_path, monkeypatch):
    from freetoken.moe import tuning
    from freetoken.moe.chooser import ModeChooser

    monkeypatch.setattr(tuning, "ModeChooser", lambda **kw: ModeChooser(settle=1, measure=2, **kw))
    monkeypatch.setattr(tuning, "EXPLORE_AFTER", 0)
    monkeypatch.setattr(tuning, "DUTY", 1.0)
    path, _ = tiny_model
    engine = make_engine(path, policy="adaptive", slots=9)
    backend = engine.model.model.layers[0].mlp.experts.backend
    shape = f"{len(backend.banks.layers)}x{backend.banks.num_experts}"
    backend.learned = store = Learned(tmp_path, shape)
    backend._choose_placements(backend.lru)  # as a backend built with the store does
    # four visits of a move step, a settling step and a sample each: ~12 of the decode steps;
    # room for a step dropped as an outlier (a busy machine's pause) before the check
    generate(engine, [[5, 6, 7, 8]], 40)
    saved = store.load(backend.cache.capacity)
    assert saved is not None and saved["mode"] in ("cache", "layers")
    assert set(saved["step_ms"]) == {"cache", "layers"}
    # the next load of the same experts on this machine starts there, measuring later
    monkeypatch.setattr(tuning, "EXPLORE_AFTER", 512)
    again = make_engine(path, policy="adaptive", slots=9).model.model.layers[0].mlp.experts
    again.backend.learned = store
    again.backend._choose_placements(again.backend.lru)
    chooser = again.backend.tuner.modes
    assert chooser.mode == Mode(saved["mode"]) and not chooser._plan


def test_the_locality_verdict_is_kept_and_measured_as_soon(tiny_model, tmp_path, monkeypatch):
    """A load that judged the routing's locality keeps the verdict: the next load of the same
    experts starts in that placement with no check, and measures as early as the first did
    (nothing measured stands behind the verdict)."""
    from freetoken.moe import locality, tuning

    monkeypatch.setattr(locality, "LOCALITY_STEPS", 4)
    monkeypatch.setattr(locality, "NEAR_UNIFORM", 0.0)  # any misses: the prediction serves
    path, _ = tiny_model
    engine = make_engine(path, policy="adaptive", slots=9, device_cache="on")
    backend = engine.model.model.layers[0].mlp.experts.backend
    shape = f"{len(backend.banks.layers)}x{backend.banks.num_experts}"
    backend.learned = store = Learned(tmp_path, shape)
    backend._choose_placements(backend.lru)
    predicted = backend.tuner.locality.predicted
    generate(engine, [[5, 6, 7, 8]], 12)
    assert backend.tuner.locality is None
    saved = store.load(backend.cache.capacity)
    assert saved is not None and saved["mode"] == predicted and not saved["step_ms"]
    # device, just served and judged slow for this routing, sits out the next measurements
    assert saved["sitting_out"] == {"device": backend.tuner.modes.PRUNE}
    again = make_engine(path, policy="adaptive", slots=9, device_cache="on")
    experts = again.model.model.layers[0].mlp.experts.backend
    experts.learned = store
    experts._choose_placements(experts.lru)
    assert experts.tuner.locality is None and experts.tuner.modes.mode == predicted
    assert experts.tuner.modes.retry == tuning.EXPLORE_AFTER
    assert experts.tuner.modes.sitting_out == saved["sitting_out"]
