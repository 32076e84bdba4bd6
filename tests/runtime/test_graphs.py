"""Fixed-shape decode steps (the form CUDA graphs capture) against the variable-shape path."""

from __future__ import annotations

import pytest
import torch

from freetoken.runtime import graphs as graphs_mod
from freetoken.runtime.graphs import decode_plan
from freetoken.runtime.sampling import SamplingParams
from freetoken.runtime.sequence import Sequence
from tests import fixtures
from tests.runtime.engine_util import generate, make_engine

PROMPTS = [
    [5, 17, 99, 3, 250, 11, 7],
    [300, 42],
    [128, 9, 14, 77, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13],
]


def test_fixed_shape_decode_matches_the_variable_path(tiny_model):
    path, _ = tiny_model
    plain = generate(make_engine(path), PROMPTS, 12)
    engine = make_engine(path, graphs="eager")
    fixed = generate(engine, PROMPTS, 12)
    assert [s.output_ids for s in fixed] == [s.output_ids for s in plain]
    # batches of 3, then of 2 and 1 as sequences finish at different lengths
    assert {b for b, _ in engine.graphs._buckets} >= {3}


def test_contexts_crossing_a_bucket_boundary(tiny_model, monkeypatch):
    monkeypatch.setattr(graphs_mod, "MIN_CTX", 16)
    path, _ = tiny_model
    prompt = [[(7 * i) % 400 + 1 for i in range(13)]]
    plain = generate(make_engine(path), prompt, 40)
    engine = make_engine(path, graphs="eager")
    fixed = generate(engine, prompt, 40)
    assert fixed[0].output_ids == plain[0].output_ids
    assert sorted(c for _, c in engine.graphs._buckets) == [16, 32, 64]


def test_decode_logits_agree(tiny_model):
    path, _ = tiny_model
    tokens = PROMPTS[2]
    plain, fixed = (_decode_logits(make_engine(path, graphs=g), tokens) for g in ("", "eager"))
    assert float((plain - fixed).norm() / plain.norm()) <= 1e-5


def _decode_logits(engine, tokens: list[int]) -> torch.Tensor:
    """Prefill all but the last token, then one decode step of the last; its logits."""
    seq = Sequence(list(tokens), SamplingParams(temperature=0.0), 1, frozenset())
    seq.pages = engine.kv.pool.alloc(engine.kv.pages_for(len(tokens)))
    engine._execute([(seq, len(tokens) - 1)])
    seq.num_cached = len(tokens) - 1
    assert decode_plan([(seq, 1)])
    return engine._execute([(seq, 1)]).float().cpu()[0]


def test_bucket_sizes_double_and_cap_at_the_context(tiny_model):
    path, _ = tiny_model
    g = make_engine(path, num_ctx=600, graphs="eager").graphs
    assert [g._bucket_ctx(n) for n in (1, 256, 257, 513, 600)] == [256, 256, 512, 608, 608]
    assert g.fits(4, 600) and not g.fits(5, 10) and not g.fits(1, 609)


GPU_CASES = [
    ("resident", 0),
    ("lru-pcie", 9),
    ("cpu-misses", 9),
    ("static-layers", 8),
    ("adaptive", 9),
]


@pytest.mark.gpu
@pytest.mark.parametrize("policy,slots", GPU_CASES)
def test_captured_decode_matches_transformers_and_eager(tiny_model, policy, slots):
    path, hf = tiny_model
    engine = make_engine(path, device="cuda", policy=policy, slots=slots, graphs="capture")
    seqs = generate(engine, [PROMPTS[0], PROMPTS[2]], 24)
    assert engine.graphs.capture, "capture fell back to eager"
    assert engine.graphs.captures >= 1
    for s, p in zip(seqs, (PROMPTS[0], PROMPTS[2])):
        assert s.output_ids == fixtures.hf_greedy(hf, p, 24)
    eager = make_engine(path, device="cuda", policy=policy, slots=slots)
    plain, captured = (_decode_logits(e, PROMPTS[2]) for e in (eager, engine))
    assert float((plain - captured).norm() / plain.norm()) <= 1e-5
    backend = engine.model.model.layers[0].mlp.experts.backend
    # two sequences decode together: their books stay on the device where every miss is
    # fetched (lru-pcie, adaptive's device placement) or the CPU lane computes a share of
    # them (cpu-misses, split), else on the host, and layers that need the host cut the
    # graph (one CPU layer in static-layers' shape)
    host_layers = sum(not backend.device_only(l, 2) for l in engine.model.moe_layers)
    shape = backend.placement.mode if policy == "adaptive" else policy
    lane = 0 if backend.lane is not None else 2
    want = {"resident": 0, "lru-pcie": 0, "device": 0, "static-layers": 1, "layers": 1}
    want |= {"cpu-misses": lane, "split": lane}
    assert host_layers == want.get(shape, 2)
    # one sequence left: lru-pcie keeps its books on the device, so nothing cuts the graph
    if policy in ("resident", "lru-pcie"):
        assert all(backend.device_only(l, 1) for l in engine.model.moe_layers)
    for (b, _), bk in engine.graphs._buckets.items():
        assert len(bk.segments) == 1 + sum(
            not backend.device_only(l, b) for l in engine.model.moe_layers
        )


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["lru-pcie", "adaptive"])
def test_single_token_steps_with_device_books_are_one_graph(tiny_model, policy):
    from freetoken.moe import chooser

    path, hf = tiny_model
    engine = make_engine(path, device="cuda", policy=policy, slots=9, graphs="capture")
    backend = engine.model.model.layers[0].mlp.experts.backend
    if policy == "adaptive":  # settle on the device-kept books
        backend.tuner.modes = chooser.ModeChooser(modes=("device",))
    for p in (PROMPTS[0], PROMPTS[2]):
        (seq,) = generate(engine, [p], 24)
        assert seq.output_ids == fixtures.hf_greedy(hf, p, 24)
    assert backend.lru.live and backend.placement.mode == (
        "device" if policy == "adaptive" else "cache"
    )
    assert {len(bk.segments) for (b, _), bk in engine.graphs._buckets.items() if b == 1} == {1}
    eager = make_engine(path, device="cuda", policy=policy, slots=9)
    plain, captured = (_decode_logits(e, PROMPTS[2]) for e in (eager, engine))
    assert float((plain - captured).norm() / plain.norm()) <= 1e-5
    stats = backend.stats()  # counted on the device, read back
    assert stats["cache"]["misses"] > 0 and stats["cache"]["hits"] > 0


@pytest.mark.gpu
def test_a_resize_recaptures(tiny_model):
    path, hf = tiny_model
    engine = make_engine(path, device="cuda", policy="lru-pcie", slots=12, graphs="capture")
    generate(engine, [PROMPTS[0]], 4)
    before = engine.graphs.captures
    backend = engine.model.model.layers[0].mlp.experts.backend
    backend.resize(9)
    (seq,) = generate(engine, [PROMPTS[0]], 24)
    assert engine.graphs.captures > before
    assert seq.output_ids == fixtures.hf_greedy(hf, PROMPTS[0], 24)


def test_a_failed_capture_first_moves_the_books_to_the_host(tiny_model, monkeypatch):
    """A capture that fails with the cache's books on the device retries with them on the
    host (graphs cut at the experts ops); only a second failure decodes without graphs."""
    path, hf = tiny_model
    engine = make_engine(path, policy="lru-pcie", slots=9, graphs="eager", device_cache="on")
    graphs = engine.graphs
    graphs.capture = True
    tries = []

    def fail(bk):
        tries.append(bk.batch)
        raise RuntimeError("not capturable")

    monkeypatch.setattr(graphs, "_capture", fail)
    backend = engine.model.model.layers[0].mlp.experts.backend
    (seq,) = generate(engine, [PROMPTS[0]], 12)
    assert seq.output_ids == fixtures.hf_greedy(hf, PROMPTS[0], 12)
    assert tries == [1, 1] and backend.lru is None and not graphs.capture


@pytest.mark.gpu
def test_split_steps_cut_at_every_layer_and_stay_exact(tiny_model):
    """Books on the device with a share of the misses on the CPU: each layer needs the host
    (graphs cut there), the pinned copies overlap the fetch, the tokens stay transformers'."""
    from freetoken.moe import chooser

    path, hf = tiny_model
    # without the CPU lane: with it a split step is one graph (tests/moe/test_lane.py)
    engine = make_engine(
        path, device="cuda", policy="adaptive", slots=9, graphs="capture", cpu_lane="off"
    )
    backend = engine.model.model.layers[0].mlp.experts.backend
    backend.tuner.modes = chooser.ModeChooser(modes=("split",))
    (seq,) = generate(engine, [PROMPTS[2]], 32)
    assert seq.output_ids == fixtures.hf_greedy(hf, PROMPTS[2], 32)
    assert backend.placement.mode == "split" and engine.graphs.capture
    layers = len(engine.model.moe_layers)
    assert {len(bk.segments) for (b, _), bk in engine.graphs._buckets.items() if b == 1} == {
        1 + layers
    }
    s = backend.stats()
    assert 0 < s["q"] < s["m"] and s["cpu_routes"] > 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_warming_runs_every_batch_size_and_leaves_nothing_behind(tiny_model, device):
    """A decode step of each batch size at the smallest and largest context, before any
    request: the page it borrows goes back, and answers are transformers' after it."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    path, hf = tiny_model
    mode = "capture" if device == "cuda" else "eager"
    engine = make_engine(path, device=device, policy="lru-pcie", slots=9, graphs=mode)
    free = engine.kv.pool.num_free
    assert engine.graphs.warm(engine.kv.pool) == 2 * engine.graphs.max_batch
    assert engine.kv.pool.num_free == free
    assert len(engine.graphs._buckets) == 2 * engine.graphs.max_batch
    seqs = generate(engine, [PROMPTS[0], PROMPTS[2]], 16)
    assert [s.output_ids for s in seqs] == [
        fixtures.hf_greedy(hf, p, 16) for p in (PROMPTS[0], PROMPTS[2])
    ]


def test_one_sequence_is_warmed_at_every_context_bucket_between_the_ends(tiny_model):
    """A first answer grows through the context buckets: the load has captured them all."""
    path, hf = tiny_model
    engine = make_engine(path, policy="lru-pcie", slots=9, graphs="eager", num_ctx=2048)
    g = engine.graphs
    assert [(ctx, list(b)) for ctx, b in g._warm_shapes()] == [
        (256, list(range(1, g.max_batch + 1))),
        (512, [1]),
        (1024, [1]),
        (2048, list(range(1, g.max_batch + 1))),
    ]
    assert g.warm(engine.kv.pool) == 2 * g.max_batch + 2
    assert {(1, 512), (1, 1024)} <= set(g._buckets)
    (seq,) = generate(engine, [PROMPTS[0]], 8)
    assert seq.output_ids == fixtures.hf_greedy(hf, PROMPTS[0], 8)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_move_back_replays_the_placements_own_graphs(tiny_model, monkeypatch, device):
    """Adaptive moves between placements to measure them, and each move recaptured every
    graph it then ran. Now one generation's graphs are kept by placement: moving back
    replays them; whole layers moved to the CPU replace tensors and drop them all. On a
    CPU the capture is stood in for (the bookkeeping is what is under test), on a GPU it is
    real; the tokens are transformers' throughout."""
    from freetoken.moe import chooser

    path, hf = tiny_model
    graphs_kind = "capture" if device == "cuda" else "eager"
    engine = make_engine(
        path, device=device, policy="adaptive", slots=9, graphs=graphs_kind, device_cache="on"
    )
    graphs = engine.graphs
    captured = []
    if device == "cpu":
        graphs.capture = True
        monkeypatch.setattr(graphs, "_replay", graphs._forward)
        monkeypatch.setattr(graphs, "_capture", lambda bk: bk.segments.append((None, None)))
    real = graphs._new_bucket
    monkeypatch.setattr(
        graphs, "_new_bucket", lambda b, c: (captured.append(graphs._variant), real(b, c))[1]
    )
    backend = engine.model.model.layers[0].mlp.experts.backend
    for mode, new in (
        ("device", ["device"]),
        ("split", ["split"]),
        ("device", []),  # kept since its first visit
        ("split", []),
        ("layers", ["layers"]),  # whole layers on the CPU: every graph dropped
        ("device", ["device"]),
    ):
        backend.tuner.modes = chooser.ModeChooser(modes=(mode,))
        captured.clear()
        (seq,) = generate(engine, [PROMPTS[0]], 12)
        assert seq.output_ids == fixtures.hf_greedy(hf, PROMPTS[0], 12), mode
        assert backend.placement.mode == mode and captured == new, mode
