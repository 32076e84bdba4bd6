"""Guessing the next layer's experts and fetching them ahead: a right guess turns the next
layer's misses into hits, a wrong one changes no slot's contents nor any result, and a
model decoding through it stays transformers'."""

from __future__ import annotations

import pytest
import torch

from freetoken.layers.routers import Router
from freetoken.moe.lookahead import Lookahead
from tests import fixtures
from tests.moe import test_device_lru as books
from tests.runtime.engine_util import full_logits, generate, make_engine


class Fixed(Router):
    """Routes every token to the same experts."""

    def __init__(self, experts: list[int], by_token: bool = False):
        super().__init__()
        self.experts, self.top_k, self.by_token = experts, len(experts), by_token

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.tensor([self.experts] * x.shape[0])
        return torch.full(ids.shape, 1.0 / self.top_k), ids


def lookahead(guesses: dict[int, list[int]]) -> Lookahead:
    routers = {layer: Fixed(e) for layer, e in guesses.items()}
    return Lookahead(routers, list(range(books.L)), torch.device("cpu"), lambda n: False)


def test_a_right_guess_turns_the_next_layers_misses_into_hits():
    hb, cache, lru = books.setup(slots=4 * books.K)
    lru.push()
    ahead = lookahead({1: [3, 5, 7]})
    x = torch.randn(1, 8)
    lru(0, torch.tensor([[0, 1, 2]]))
    ahead.after(0, x, lru)
    ahead.join(1)
    slots = lru(1, torch.tensor([[7, 3, 5]]))
    assert lru.counts[1].tolist() == [3, 0, 0, 0]  # hits, misses, evictions, fetches
    assert ahead.counts[1].tolist() == [0, 3, 0, 3] and ahead.fetched() == 3
    assert ahead.counts[0].tolist() == [0, 0, 0, 0]
    books.check(hb, cache, lru)
    for s, e in zip(slots.view(-1).tolist(), (7, 3, 5), strict=True):
        assert torch.equal(cache.slots["gate_up"][s], hb.banks[1]["gate_up"][e])


def test_a_wrong_guess_costs_fetches_not_results():
    hb, cache, lru = books.setup(slots=2 * books.K)  # every guess evicts what the layer before used
    lru.push()
    ahead = lookahead({1: [9, 10, 11], 2: [0, 1, 2]})
    for step in range(4):
        for layer in range(3):
            ahead.join(layer)
            ids = torch.tensor([[(layer + step) % 12, 4, 6]])
            slots = lru(layer, ids)
            ahead.after(layer, torch.randn(1, 8), lru)
            for s, e in zip(slots.view(-1).tolist(), ids.view(-1).tolist(), strict=True):
                assert torch.equal(cache.slots["down"][s], hb.banks[layer]["down"][e])
            books.check(hb, cache, lru)
    assert ahead.fetched() > 0 and int(lru.counts[1:3, 1].sum()) > 0


def test_no_guess_for_a_layer_off_the_device_or_a_router_by_token():
    hb, cache, lru = books.setup(slots=4 * books.K)
    lru.push()
    routers = {1: Fixed([1, 2, 3]), 2: Fixed([1, 2, 3], by_token=True), 3: Fixed([4, 5, 6])}
    on_cpu = {1}  # layer 1 on the CPU
    ahead = Lookahead(routers, list(range(books.L)), torch.device("cpu"), on_cpu.__contains__)
    assert ahead.next == {0: 1, 2: 3}
    ahead.after(0, torch.randn(1, 8), lru)  # layer 1 on the CPU: no guess
    ahead.after(1, torch.randn(1, 8), lru)  # layer 2 routes by token: no guess
    assert ahead.fetched() == 0
    ahead.after(2, torch.randn(1, 8), lru)  # layer 3: on the device, by its weights
    assert ahead.fetched() == 3
    assert Lookahead.fits(lru, 2 * books.K) and not Lookahead.fits(lru, 2 * books.K + 1)


@pytest.mark.parametrize("policy", ["lru-pcie", "adaptive"])
def test_decode_with_guesses_matches_transformers(tiny_model, policy):
    from freetoken.moe import chooser

    path, hf = tiny_model
    engine = make_engine(path, policy=policy, slots=5, device_cache="on", lookahead="on")
    backend = engine.model.model.layers[0].mlp.experts.backend
    if policy == "adaptive":  # the device placement: every miss fetched
        backend.tuner.modes = chooser.ModeChooser(modes=("device",))
    p = [(7 * i) % 500 + 1 for i in range(9)]
    (seq,) = generate(engine, [p], 24)
    assert seq.output_ids == fixtures.hf_greedy(hf, p, 24)
    assert backend.lru.live and backend.stats()["guessed"] > 0
    resident = make_engine(path, policy="resident")
    assert float((full_logits(engine, p) - full_logits(resident, p)).abs().max()) <= 1e-5


@pytest.mark.gpu
def test_captured_steps_fetch_ahead_on_a_side_stream(tiny_model):
    path, hf = tiny_model
    kw = dict(device="cuda", policy="lru-pcie", slots=5, lookahead="on")
    engine = make_engine(path, graphs="capture", **kw)
    backend = engine.model.model.layers[0].mlp.experts.backend
    prompts = [[(7 * i) % 500 + 1 for i in range(9)], [(3 * i) % 500 + 2 for i in range(13)]]
    for p in prompts:
        (seq,) = generate(engine, [p], 24)
        assert seq.output_ids == fixtures.hf_greedy(hf, p, 24)
    assert engine.graphs.capture and backend.lru.live
    assert {len(bk.segments) for (b, _), bk in engine.graphs._buckets.items() if b == 1} == {1}
    assert backend.stats()["guessed"] > 0
    guessed = backend.stats()["guessed"]
    (seq,) = generate(engine, [prompts[0]], 8)  # replays fetch ahead too
    assert backend.stats()["guessed"] > guessed
    off = make_engine(path, graphs="capture", **{**kw, "lookahead": "off"})
    (seq_off,) = generate(off, [prompts[0]], 8)
    assert seq_off.output_ids == seq.output_ids
    assert off.model.model.layers[0].mlp.experts.backend.stats()["guessed"] == 0
