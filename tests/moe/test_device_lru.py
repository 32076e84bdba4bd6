"""The cache's books kept on the device: exact LRU order against a plain-Python cache,
invariants and slot contents across hand-overs to the host, and exact models through it."""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
import torch

from freetoken.models.base import ExpertSpec
from freetoken.moe.banks import HostBanks
from freetoken.moe.cache import ExpertCache
from freetoken.moe.chooser import ModeChooser
from freetoken.moe.device_lru import STRIDE, DeviceLRU
from tests import fixtures
from tests.runtime.engine_util import full_logits, generate, make_engine

L, E, K, H, I = 5, 12, 3, 8, 4


def banks(seed: int = 0) -> HostBanks:
    g = torch.Generator().manual_seed(seed)
    raw = {}
    for layer in range(L):
        raw[(layer, "gate_up")] = torch.randn((E, 2 * I, H), generator=g)
        raw[(layer, "down")] = torch.randn((E, H, I), generator=g)
    return HostBanks(raw, torch.float32, pin=False, spec=ExpertSpec(H, I))


def setup(slots: int) -> tuple[HostBanks, ExpertCache, DeviceLRU]:
    hb = banks()
    cache = ExpertCache(L, E, slots, hb.rows, hb.dtypes, torch.device("cpu"))
    return hb, cache, DeviceLRU(cache, hb, torch.device("cpu"))


class RefLRU:
    """A plain-Python LRU that stamps one call's routes in route order."""

    def __init__(self, slots: int):
        self.owner: list[tuple[int, int] | None] = [None] * slots
        self.stamp = [i - slots - 1 for i in range(slots)]  # empty slots first, in slot order
        self.where: dict[tuple[int, int], int] = {}
        self.clock = 1
        self.evictions = 0

    def call(self, layer: int, experts: list[int]) -> list[int]:
        now = [self.clock * STRIDE + j for j in range(len(experts))]
        slots = [self.where.get((layer, e), -1) for e in experts]
        for j, s in enumerate(slots):
            if s >= 0:
                self.stamp[s] = now[j]
        victims = iter(sorted(range(len(self.owner)), key=self.stamp.__getitem__))
        for j, e in enumerate(experts):
            if slots[j] < 0:
                s = next(victims)
                if self.owner[s] is not None:
                    del self.where[self.owner[s]]
                    self.evictions += 1
                self.owner[s], self.where[(layer, e)], self.stamp[s], slots[j] = (
                    (layer, e),
                    s,
                    now[j],
                    s,
                )
        self.clock += 1
        return slots


def check(hb: HostBanks, cache: ExpertCache, lru: DeviceLRU) -> None:
    """No slot holds two experts, the maps agree, and every slot holds its expert's bytes."""
    owner = lru.owner[:-1].numpy()
    slot_of = lru.slot_of[:-1].numpy().reshape(L, E)
    held = owner[owner >= 0]
    assert len(set(held.tolist())) == len(held)
    for s, o in enumerate(owner.tolist()):
        if o >= 0:
            layer, e = divmod(o, E)
            assert slot_of[layer, e] == s
            assert torch.equal(cache.slots["gate_up"][s], hb.banks[layer]["gate_up"][e])
            assert torch.equal(cache.slots["down"][s], hb.banks[layer]["down"][e])
    assert (slot_of >= 0).sum() == len(held)


def _skewed(rng, tokens: int) -> list[list[int]]:
    """Each token's K distinct experts from a skewed stream, so some experts stay hot and
    others come and go (and the tokens of a step share some)."""
    p = np.arange(E, 0, -1) / (E * (E + 1) / 2)
    return [rng.choice(E, K, replace=False, p=p).tolist() for _ in range(tokens)]


@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("slots", [E, 2 * E + 5, 40])
def test_eviction_order_is_exactly_lru(slots, tokens):
    """A step of several tokens books its distinct experts once, in order of first route."""
    hb, cache, lru = setup(slots)
    ref = RefLRU(slots)
    rng = np.random.default_rng(slots)
    lru.push()
    routes = 0
    for step in range(300):
        layer = int(rng.integers(L))
        experts = _skewed(rng, tokens)
        got = lru(layer, torch.tensor(experts))
        assert got.shape == (tokens, K)
        distinct = list(dict.fromkeys(e for token in experts for e in token))
        slot = dict(zip(distinct, ref.call(layer, distinct)))
        assert got.tolist() == [[slot[e] for e in token] for token in experts], f"step {step}"
        routes += len(distinct)
    check(hb, cache, lru)
    misses, fetched = lru.pull()
    assert (
        cache.hits.sum() + cache.misses.sum() == routes and misses == fetched == cache.misses.sum()
    )
    assert cache.evictions == ref.evictions


def test_books_survive_hand_overs_to_the_host():
    hb, cache, lru = setup(20)
    rng = np.random.default_rng(1)
    for _ in range(12):
        lru.push()
        for _ in range(25):
            layer, experts = int(rng.integers(L)), rng.choice(E, K, replace=False)
            slots = lru(layer, torch.from_numpy(experts)[None])[0].numpy()
            assert (
                lru.owner[slots].numpy() == layer * E + experts
            ).all()  # every route's expert is in its slot
        check(hb, cache, lru)
        lru.pull()
        # the host cache goes on from the same books: its own lookups, fetches and evictions
        layer, experts = int(rng.integers(L)), rng.choice(E, K, replace=False)
        slots = cache.lookup(layer, experts)
        miss = slots < 0
        if miss.any():
            got = cache.allocate(layer, experts[miss], slots[~miss])
            for e, s in zip(experts[miss].tolist(), got.tolist()):
                cache.slots["gate_up"][s].copy_(hb.banks[layer]["gate_up"][e])
                cache.slots["down"][s].copy_(hb.banks[layer]["down"][e])
        cache.touch(cache.lookup(layer, experts))
        held = np.flatnonzero(cache.owner >= 0)
        assert (cache.slot_of[cache.owner[held] // E, cache.owner[held] % E] == held).all()
        assert int((cache.slot_of >= 0).sum()) == len(held)
    lru.push()
    check(hb, cache, lru)


def _books_devices() -> list:
    # the fused kernel also runs in Triton's interpreter, where that is installed and asked for
    interp = (
        os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
    )
    return [
        pytest.param("cuda", marks=pytest.mark.gpu),
        pytest.param(
            "cpu",
            marks=pytest.mark.skipif(not interp, reason="needs TRITON_INTERPRET=1 and triton"),
        ),
    ]


@pytest.mark.parametrize("device", _books_devices())
@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("slots", [E + 1, 2 * E + 5, 40])
def test_fused_books_kernel_keeps_the_same_books(device, slots, tokens):
    """The one-kernel books against the device ops: same slots, fetches, CPU routes and books
    after every call of a long stream, with and without a share, around fixed slots, for
    steps of one token and of several that share experts."""
    evicted = _same_books(device, slots, tokens, layers=L, fixed=True)
    assert evicted > 0  # the stream did evict


@pytest.mark.parametrize("device", _books_devices())
def test_fused_books_kernel_when_a_fetch_takes_a_hits_slot(device):
    """A pool barely larger than a step's routes: a step's fetches take the slot of one of its
    own hits, whose route then reads -1 (the CPU's), as the device ops' books give it."""
    _same_books(device, 7, 3, layers=1, fixed=False, hits_taken=True)


def _same_books(device, slots, tokens, layers, fixed, hits_taken=False) -> int:
    """Runs the device ops and the fused kernel side by side over a random stream (steps of
    `tokens` tokens on the first `layers` layers), comparing every result and the books after
    each step; returns the evictions. With `hits_taken`, asserts some step's fetch took the
    slot of one of its own hits."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device(device)
    lrus = []
    for _ in range(2):
        hb = banks()
        cache = ExpertCache(L, E, slots, hb.rows, hb.dtypes, dev)
        if fixed:
            cache.fix(0, np.array([1]))  # one slot that is never a victim
        lrus.append(DeviceLRU(cache, hb, dev))
    ops, fused = lrus
    ops.fused = False
    rng = np.random.default_rng(slots)
    for lru in lrus:
        lru.push()
    taken = 0
    for step in range(400 if device == "cuda" else 150):  # the interpreter is slow
        layer = int(rng.integers(layers))
        ids = torch.tensor(np.array([rng.choice(E, K, replace=False) for _ in range(tokens)]))
        ids = ids.to(dev)
        split = step % 3 == 0
        if split:
            share = float(rng.choice([0.0, 0.34, 0.5, 1.0]))
            for lru in lrus:
                lru.share.fill_(share)
        held = ops.slot_of.index_select(0, ids.reshape(-1) + layer * E) >= 0
        want = ops.assign(layer, ids, split)
        got = fused.assign_fused(layer, ids, split, fused.counts[layer])
        for w, g in zip(want, got):
            assert torch.equal(w.cpu(), g.cpu()), f"step {step}"
        taken += int((held & (want[0].reshape(-1) < 0)).sum())
        for name in ("slot_of", "owner", "stamp"):  # the last entry of each is scratch
            assert torch.equal(getattr(ops, name)[:-1].cpu(), getattr(fused, name)[:-1].cpu()), (
                f"{name}, step {step}"
            )
        assert torch.equal(ops.clock.cpu(), fused.clock.cpu()) and torch.equal(
            ops.counts.cpu(), fused.counts.cpu()
        )
    assert taken > 0 or not hits_taken
    return int(fused.counts[:, 2].sum())


@pytest.mark.parametrize("policy", ["lru-pcie", "adaptive"])
def test_decode_through_device_books_matches_transformers(tiny_model, policy, monkeypatch):
    from freetoken.moe import tuning

    # adaptive measures each placement for a few steps only, so all three run in one generation
    monkeypatch.setattr(
        tuning,
        "ModeChooser",
        lambda **kw: ModeChooser(settle=1, measure=2, period=7, **kw),
    )
    # every measurement visits every placement, a period apart: where one placement timed
    # far faster (a loaded machine's steps vary), pruning the others and backing off kept
    # the two sequences' steps in it and none ran with the books on the host
    monkeypatch.setattr(ModeChooser, "SLOW", float("inf"))
    monkeypatch.setattr(ModeChooser, "MAX_BACKOFF", 1)
    # and from device as well: the miss gate asks a few steps' misses and lets every one by
    monkeypatch.setattr(tuning, "WINDOW_STEPS", 2)
    monkeypatch.setattr(tuning, "SETTLED", float("inf"))  # two-step windows never agree
    monkeypatch.setattr(tuning, "MIN_GAIN", 0.0)
    monkeypatch.setattr(tuning, "SPLIT_GAIN", 0.0)
    # visited, not tried at the gate's word: a trial of split would take every later turn
    monkeypatch.setattr(tuning, "TRIED", ())
    # measuring from the first step, every placement in turn
    monkeypatch.setattr(tuning, "EXPLORE_AFTER", 0)
    monkeypatch.setattr(tuning, "DUTY", 1.0)
    # every step counts: beside other tests a step can take many times the one before, which
    # the tuner would take for idle time and not count, and the visits would not come round
    monkeypatch.setattr(tuning, "IDLE_FACTOR", float("inf"))
    path, hf = tiny_model
    engine = make_engine(path, policy=policy, slots=9, device_cache="on")
    backend = engine.model.model.layers[0].mlp.experts.backend
    modes = []
    step = backend.between_steps
    backend.between_steps = lambda tokens: (
        step(tokens),
        modes.append((tokens, backend.placement.mode, backend.lru.live)),
    )
    prompts = [
        [(7 * i) % 500 + 1 for i in range(n)] for n in (5, 40)
    ]  # the long one prefills on the host
    for p in prompts:
        (seq,) = generate(engine, [p], 24)
        assert seq.output_ids == fixtures.hf_greedy(hf, p, 24)
    assert (1, "device" if policy == "adaptive" else "cache", True) in modes
    assert any(t > 1 and not live for t, _, live in modes)  # prompts ran with the books on the host
    if policy == "adaptive":
        assert {"device", "split", "cache", "layers"} <= {m for _, m, _ in modes}
    # two sequences at once: their decode steps book on the device too, where every miss is
    # fetched (lru-pcie, or adaptive's device placement)
    modes.clear()
    seqs = generate(engine, prompts, 24)  # a measurement's visits to the host-kept books
    assert [s.output_ids for s in seqs] == [fixtures.hf_greedy(hf, p, 24) for p in prompts]
    on_device = {mode for t, mode, live in modes if t == 2 and live}
    assert on_device == {"cache"} if policy == "lru-pcie" else on_device <= {"device"}
    assert policy == "lru-pcie" or any(t == 2 and not live for t, _, live in modes)
    if policy == "adaptive":  # settle on the device-kept books
        backend.tuner.modes = ModeChooser(modes=("device",))
    generate(engine, [prompts[0]], 4)  # ends with the books on the device
    assert backend.lru.live
    # statistics (read from other threads while steps run) count the device's work and leave
    # the books where they are
    stats = backend.stats()
    assert backend.lru.live and backend.stats()["cache"] == stats["cache"]
    assert (
        stats["cache"]["misses"] > 0
        and stats["cache"]["hits"] > 0
        and stats["m"] >= stats["cache"]["misses"]
    )
    backend.between_steps(40)  # a prefill chunk: the host takes the books, the same totals
    assert not backend.lru.live and backend.stats()["cache"] == stats["cache"]


def test_resize_keeps_device_books_exact(tiny_model):
    path, hf = tiny_model
    engine = make_engine(path, policy="lru-pcie", slots=12, device_cache="on")
    resident = make_engine(path, policy="resident")
    backend = engine.model.model.layers[0].mlp.experts.backend
    p = [(11 * i) % 500 + 1 for i in range(9)]
    generate(engine, [p], 6)
    assert backend.lru.live
    backend.resize(8)
    assert not backend.lru.live and backend.lru.cache.capacity == 8
    (seq,) = generate(engine, [p], 16)
    assert seq.output_ids == fixtures.hf_greedy(hf, p, 16)
    assert float((full_logits(engine, p) - full_logits(resident, p)).abs().max()) <= 1e-5


def test_split_shares_misses_between_fetches_and_the_cpu(tiny_model):
    """Books on the device, a share of each layer's misses fetched and the rest computed on
    the CPU: the tokens stay transformers', and both paths did work."""

    path, hf = tiny_model
    engine = make_engine(path, policy="adaptive", slots=9, device_cache="on")
    backend = engine.model.model.layers[0].mlp.experts.backend
    backend.tuner.modes = ModeChooser(modes=("split",))
    p = [(5 * i) % 500 + 3 for i in range(11)]
    (seq,) = generate(engine, [p], 40)  # the share tuner tries every share meanwhile
    assert seq.output_ids == fixtures.hf_greedy(hf, p, 40)
    assert backend.placement.mode == "split" and backend.lru.live
    assert not backend.device_only(engine.model.moe_layers[0])  # the host takes part in every layer
    s = backend.stats()
    assert 0 < s["q"] < s["m"] and s["cpu_routes"] > 0
    assert (
        s["cache"]["fetches"] == s["q"] and s["cache"]["misses"] == s["m"]
    )  # every miss was booked


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["device", "split"])
def test_misses_fetched_by_the_expert_kernels_match_transformers(tiny_model, mode, monkeypatch):
    """FREETOKEN_FUSED_FETCH: the expert kernels read each miss the books fill from host
    memory and write it into its slot, no fetch kernel launched — transformers' greedy
    tokens at one token and a batch (in split the CPU lane takes a share), and every slot
    the device's books name holds its expert's bytes."""
    from freetoken import config
    from freetoken.moe import chooser

    monkeypatch.setenv("FREETOKEN_FUSED_FETCH", "1")
    config.current.cache_clear()
    path, hf = tiny_model
    engine = make_engine(
        *(path,), policy="adaptive", slots=9, device="cuda", device_cache="on",
        cpu_lane="on", graphs="capture",
    )  # fmt: skip
    backend = engine.model.model.layers[0].mlp.experts.backend
    backend.tuner.modes = chooser.ModeChooser(modes=(mode,))
    fetched = []
    monkeypatch.setattr(DeviceLRU, "fetch", lambda self, *a: fetched.append(a))
    try:
        for p in ([(5 * i) % 500 + 3 for i in range(11)], [(7 * i) % 500 + 1 for i in range(40)]):
            (seq,) = generate(engine, [p], 32)
            assert seq.output_ids == fixtures.hf_greedy(hf, p, 32)
        prompts = [[(3 * i + j) % 500 + 2 for i in range(6 + j)] for j in range(3)]
        for seq, p in zip(generate(engine, prompts, 12), prompts):
            assert seq.output_ids == fixtures.hf_greedy(hf, p, 12)
        assert backend.placement.mode == mode and backend.lru.live and not fetched
        assert backend.stats()["cache"]["fetches"] > 0
        lru, E = backend.lru, backend.cache.E
        owners = lru.owner[:-1].cpu()
        for slot in (owners >= 0).nonzero().flatten().tolist():
            layer, e = divmod(int(owners[slot]), E)
            for name, bank in backend.banks.banks[layer].items():
                assert torch.equal(backend.cache.slots[name][slot].cpu(), bank[e]), (slot, name)
    finally:
        if backend.lane is not None:
            backend.lane.stop()
        monkeypatch.undo()
        config.current.cache_clear()
