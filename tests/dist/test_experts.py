"""The distributed experts op gives the single-process model's logits (gloo, CPU ranks)."""

from __future__ import annotations

import pytest
import torch

from freetoken import dist
from freetoken.dist import experts as dx
from freetoken.layers.context import SeqSpan, StepContext, step_context
from tests.dist.util import backend, cuda_devices, dist_engine
from tests.runtime.engine_util import full_logits, generate, make_engine

PROMPT = [5, 17, 99, 3, 250, 11, 7, 300, 42, 128, 64, 200]
LONG = [(7 * i + 3) % 500 for i in range(48)]  # a prefill chunk of more than 32 routes per rank


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def stepwise_logits(engine, ids: list[int], first: int) -> torch.Tensor:
    """Logits of a prefill of ids[:first], then of each later token decoded through the KV cache."""
    kv = engine.kv
    pages = kv.pool.alloc(kv.pages_for(len(ids)))
    rows = []
    try:
        for start, end in [(0, first)] + [(i, i + 1) for i in range(first, len(ids))]:
            ctx_slots = kv.slots_of(pages, 0, end, engine.device)
            dev = engine.device
            ctx = StepContext(
                torch.arange(start, end, device=dev),
                ctx_slots[start:],
                [SeqSpan(0, end - start, end, ctx_slots)],
                kv,
                torch.arange(end - start, device=dev),
            )
            with torch.inference_mode(), step_context(ctx):
                h = engine.model(torch.tensor(ids[start:end], device=dev), ctx.positions)
                rows.append(engine.model.logits(h).float().cpu())
    finally:
        kv.pool.release(pages)
    return torch.cat(rows)


@pytest.fixture(scope="module")
def tiny_ftw(tiny_model, tmp_path_factory):
    from freetoken.ftw.convert import convert

    return convert(tiny_model[0], tmp_path_factory.mktemp("ftw") / "tiny", shard_limit=64 * 4096)


@pytest.fixture(scope="module")
def reference(tiny_model):
    path, _ = tiny_model
    return make_engine(path, policy="resident", slots=16, page_size=4, pages=128)


@pytest.fixture(scope="module")
def three_layers(tmp_path_factory):
    """Three MoE layers: a rank's pool can stream prefill yet fall short of its experts (with
    two, a pool of two layers' slots holds every expert, which are then fixed)."""
    from tests import fixtures

    path = tmp_path_factory.mktemp("tiny-3-layers")
    fixtures.hf_qwen3_moe(path, seed=5, num_hidden_layers=3)
    return path, make_engine(path, policy="resident", slots=24, page_size=4, pages=128)


def test_share_gives_every_expert_to_one_rank():
    for E, world in [(8, 2), (8, 3), (128, 3), (5, 5)]:
        blocks = [dist.share(E, world, r) for r in range(world)]
        assert blocks[0][0] == 0 and blocks[-1][1] == E
        assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
        assert max(hi - lo for lo, hi in blocks) - min(hi - lo for lo, hi in blocks) <= 1
    with pytest.raises(ValueError, match="8 experts per layer cannot be spread over 9 ranks"):
        dist.share(8, 9, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_payload_round_trip(dtype):
    x, ids, w = (
        torch.randn(3, 64).to(dtype),
        torch.randint(0, 128, (3, 8)),
        torch.rand(3, 8).to(dtype),
    )
    buf = dx.pack(x, ids, w)
    assert buf.numel() == dx.payload_bytes(3, 8, 64, dtype)
    x2, ids2, w2 = dx.unpack(buf, 3, 8, 64, dtype)
    assert torch.equal(x2, x) and torch.equal(ids2, ids) and torch.equal(w2, w)


def test_local_part_sums_only_the_ranks_own_routes():
    calls = []

    def local(layer, x, ids, weights):  # stands in for a rank's offload backend
        calls.append(ids.squeeze(1).tolist())
        return x * weights

    x = torch.ones(2, 4)
    ids = torch.tensor([[1, 6], [5, 4]])
    w = torch.tensor([[0.5, 0.25], [0.125, 1.0]])
    out = dx.local_part(local, (4, 8), 0, x, ids, w)
    assert calls == [[2, 1, 0]]  # experts 6, 5, 4 as local ids 2, 1, 0; expert 1 is another rank's
    assert torch.equal(out, torch.tensor([[0.25] * 4, [1.125] * 4]))


# world, policy, slots per rank, source: a slot pool with room to stream prefill layers (2
# ranks of 4 experts a layer, 3 layers), a pool too small for streaming so misses are fetched
# one by one (3 ranks, each reading only its rows of the FTW banks), no pool at all
@pytest.mark.parametrize(
    "world,policy,slots,source",
    [(2, "adaptive", 8, "hf3"), (3, "lru-pcie", 3, "ftw"), (2, "cpu-misses", 0, "hf")],
)
def test_logits_equal_single_process(request, world, policy, slots, source):
    if source == "hf3":
        path, reference = request.getfixturevalue("three_layers")
    else:
        reference = request.getfixturevalue("reference")
        path = request.getfixturevalue("tiny_ftw" if source == "ftw" else "tiny_model")
        path = path if source == "ftw" else path[0]
    engine = dist_engine(path, world, policy=policy, slots=slots, page_size=4, pages=128)
    try:
        assert _rel(full_logits(engine, PROMPT), full_logits(reference, PROMPT)) <= 1e-5
        assert _rel(full_logits(engine, LONG), full_logits(reference, LONG)) <= 1e-5
        # a prefill, then decode steps through the KV cache
        assert (
            _rel(stepwise_logits(engine, PROMPT, 5), stepwise_logits(reference, PROMPT, 5)) <= 1e-5
        )
        # batched decode (several tokens per op) through the scheduler
        prompts = [PROMPT, PROMPT[:7], LONG[:20]]
        got = [s.output_ids for s in generate(engine, prompts, 12)]
        assert got == [s.output_ids for s in generate(reference, prompts, 12)]
        stats = backend(engine)
        stats.idle()  # the followers report their stats
        ranks = stats.stats()["ranks"]
        assert [r["rank"] for r in ranks] == list(range(world))
        assert all(r["layers"] > 0 for r in ranks), "every rank computed routes"
        if policy == "adaptive":
            assert all(r["prefill_streaming"]["chunks"] > 0 for r in ranks)
        # each rank holds its own rows of the banks, the model's experts once in all
        assert sum(r["bank_bytes"] for r in ranks) == backend(reference).banks.total_bytes
    finally:
        backend(engine).close()


def test_world_of_one_equals_the_plain_model(tiny_model):
    path, _ = tiny_model
    assert dist.devices("cpu:1", "auto") == ["cpu"] and dist.devices("auto", "cpu") == ["cpu"]
    plain = make_engine(path, policy="adaptive", slots=8)
    engine = dist_engine(path, 1, policy="adaptive", slots=8)
    try:
        assert _rel(full_logits(engine, PROMPT), full_logits(plain, PROMPT)) <= 1e-6
        assert (
            generate(engine, [PROMPT], 8)[0].output_ids
            == generate(plain, [PROMPT], 8)[0].output_ids
        )
    finally:
        backend(engine).close()


def test_resize_reaches_every_rank_and_refusals_name_the_rank(tiny_model, reference):
    path, _ = tiny_model
    engine = dist_engine(path, 2, policy="lru-pcie", slots=4)
    try:
        b = backend(engine)
        out = b.resize(6)
        assert [r["slots"] for r in out["ranks"]] == [6, 6]
        assert b.stats()["cache"]["slots"] == 12  # summed over the ranks
        with pytest.raises(
            ValueError, match=r"rank 0: 3 expert slots is below the floor of 4.*rank 1"
        ):
            b.resize(3)
        # a refusal leaves the group in step
        assert _rel(full_logits(engine, PROMPT), full_logits(reference, PROMPT)) <= 1e-5
    finally:
        b.close()


@pytest.mark.gpu
@pytest.mark.skipif(cuda_devices() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize(
    "policy,slots", [("adaptive", 8), ("lru-pcie", 3), ("cpu-misses", 3), ("resident", 0)]
)
def test_nccl_logits_equal_one_gpu(tiny_model, policy, slots):
    path, _ = tiny_model
    one = make_engine(path, device="cuda", policy="resident", page_size=4, pages=128)
    engine = dist_engine(path, 2, policy=policy, slots=slots, page_size=4, pages=128, gpus=True)
    try:
        assert _rel(full_logits(engine, PROMPT), full_logits(one, PROMPT)) <= 1e-5
        assert _rel(full_logits(engine, LONG), full_logits(one, LONG)) <= 1e-5
        assert (
            _rel(stepwise_logits(engine, PROMPT, 5).cpu(), stepwise_logits(one, PROMPT, 5).cpu())
            <= 1e-5
        )
        prompts = [PROMPT, PROMPT[:7], LONG[:20]]
        got = [s.output_ids for s in generate(engine, prompts, 12)]
        assert got == [s.output_ids for s in generate(one, prompts, 12)]
        b = backend(engine)
        b.idle()  # the follower waits on the control group now; the next op wakes it
        assert _rel(full_logits(engine, PROMPT), full_logits(one, PROMPT)) <= 1e-5
        assert [r["device"] for r in b.stats()["ranks"]] == ["cuda:0", "cuda:1"]
    finally:
        backend(engine).close()


@pytest.mark.gpu
def test_nccl_group_of_one_gpu(tiny_model):
    """The NCCL path (headers and payload on the device, the reduce, idling on gloo) on one
    GPU, with decode steps replayed from CUDA graphs that are cut at every experts op."""
    path, _ = tiny_model
    one = make_engine(path, device="cuda", policy="resident", page_size=4, pages=128)
    engine = dist_engine(
        path, 1, policy="adaptive", slots=8, page_size=4, pages=128, gpus=True, graphs=True
    )
    try:
        assert _rel(full_logits(engine, LONG), full_logits(one, LONG)) <= 1e-5
        prompts = [PROMPT, PROMPT[:7]]
        want = [s.output_ids for s in generate(one, prompts, 12)]
        assert [s.output_ids for s in generate(engine, prompts, 12)] == want
        assert engine.graphs.captures > 0
        backend(engine).idle()
        assert [s.output_ids for s in generate(engine, prompts, 12)] == want
    finally:
        backend(engine).close()
