"""GPU paths: the Triton expert kernel and every offload policy on CUDA against the resident
model."""

from __future__ import annotations

import pytest
import torch

from freetoken.kernels import moe_gpu, reference
from tests import fixtures
from tests.kernels import experts
from tests.runtime.engine_util import full_logits, generate, make_engine

pytestmark = pytest.mark.gpu
PROMPT = [5, 17, 99, 3, 250, 11, 7, 300, 42, 128]


@pytest.mark.parametrize("variant", list(experts.VARIANTS))
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("shape", [(1, 8, 2048, 768, 40), (3, 4, 64, 32, 9), (5, 2, 200, 77, 7)])
def test_triton_small_batch_kernel_matches_reference(variant, dtype, tol, shape):
    T, k, H, I, S = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    spec = experts.spec(variant, H, I)
    pool = experts.banks(S, spec, dtype, g, device="cuda", scale=True)
    x = torch.randn(T, H, device="cuda", generator=g).to(dtype)
    slots = torch.stack([torch.randperm(S, device="cuda", generator=g)[:k] for _ in range(T)])
    slots[0, 0] = -1  # a route served by the CPU contributes nothing here
    w = torch.rand(T, k, device="cuda", generator=g)
    out = moe_gpu.experts_from_slots(x, slots, w.to(dtype), pool, spec)
    keep = slots >= 0
    ref = reference.moe_experts(
        x.float(),
        torch.where(keep, slots, 0),
        torch.where(keep, w, 0.0),
        {b: t.float() for b, t in pool.items()},
        spec,
    )
    assert float((out.float() - ref).norm() / ref.norm()) <= tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [(2 * 768, 2048), (7, 33)])
def test_fetch_kernel_copies_from_pinned_banks(dtype, rows):
    from freetoken.ftw.hostmem import HostBuffer

    E, S = 11, 6
    n = E * rows[0] * rows[1]
    buf = HostBuffer(n * torch.tensor([], dtype=dtype).element_size())
    bank = buf.tensor(str(dtype).removeprefix("torch."), [E, *rows], buf.nbytes)
    bank.copy_(torch.randn(E, *rows).to(dtype))
    buf.pin()  # the kernel reads the bank where it lies, as it does the host banks
    pool = torch.zeros(S, *rows, dtype=dtype, device="cuda")
    experts = torch.tensor([3, 10, 0, 7], dtype=torch.int32, device="cuda")
    slots = torch.tensor([5, -1, 0, 2], dtype=torch.int32, device="cuda")  # -1: copies nothing
    moe_gpu.fetch_experts(bank, pool, experts, slots)
    want = torch.zeros_like(pool).cpu()
    for e, s in ((3, 5), (0, 0), (7, 2)):
        want[s] = bank[e]
    assert torch.equal(pool.cpu(), want)


@pytest.mark.parametrize("banks", [2, 3])
def test_a_layers_banks_fetched_in_pairs_from_pinned_memory(banks):
    """gate_up and down in one launch; a third bank (biases) in one of its own."""
    from freetoken.ftw.hostmem import HostBuffer

    E, S, shapes = 9, 5, [(2 * 96, 64), (64, 96), (2 * 96,)][:banks]
    pairs = []
    for shape in shapes:
        n = E * int(torch.tensor(shape).prod())
        buf = HostBuffer(n * 2)
        bank = buf.tensor("bfloat16", [E, *shape], n * 2)
        bank.copy_(torch.randn(E, *shape).bfloat16())
        buf.pin()
        pairs.append((bank, torch.zeros(S, *shape, dtype=torch.bfloat16, device="cuda"), buf))
    experts = torch.tensor([8, 2, 5], dtype=torch.int32, device="cuda")
    slots = torch.tensor([1, 4, -1], dtype=torch.int32, device="cuda")
    moe_gpu.fetch_banks([(src, dst) for src, dst, _ in pairs], experts, slots)
    for src, dst, _ in pairs:
        want = torch.zeros_like(dst).cpu()
        want[1], want[4] = src[8], src[2]
        assert torch.equal(dst.cpu(), want)


CASES = [("lru-pcie", 9), ("cpu-misses", 9), ("static-layers", 8), ("adaptive", 9)]


@pytest.fixture(scope="module")
def resident_cuda(tiny_model):
    return full_logits(make_engine(tiny_model[0], device="cuda", policy="resident"), PROMPT)


@pytest.mark.parametrize("policy,slots", CASES)
def test_policies_on_cuda_match_resident(tiny_model, resident_cuda, policy, slots):
    path, hf = tiny_model
    engine = make_engine(path, device="cuda", policy=policy, slots=slots)
    got = full_logits(engine, PROMPT)
    assert float((got.cpu() - resident_cuda.cpu()).norm() / resident_cuda.cpu().norm()) <= 1e-5
    (seq,) = generate(engine, [PROMPT], 24)
    assert seq.output_ids == fixtures.hf_greedy(hf, PROMPT, 24)


def test_resident_cuda_matches_transformers(tiny_model, resident_cuda):
    _, hf = tiny_model
    ref = fixtures.hf_logits(hf, PROMPT)
    assert float((resident_cuda.cpu() - ref).norm() / ref.norm()) <= 1e-4


def test_bf16_policies_stay_close_to_resident(tiny_model, tmp_path):
    import json

    path, _ = tiny_model
    # the same weights, loaded as bf16
    for f in path.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["torch_dtype"] = "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ref = full_logits(make_engine(tmp_path, device="cuda", policy="resident"), PROMPT).cpu()
    for policy, slots in CASES:
        got = full_logits(
            make_engine(tmp_path, device="cuda", policy=policy, slots=slots), PROMPT
        ).cpu()
        assert float((got - ref).norm() / ref.norm()) <= 1e-2, policy


@pytest.fixture(scope="module")
def three_layers(tmp_path_factory):
    """24 experts: a pool of 20 streams prefill (one that holds every expert fixes them)."""
    path = tmp_path_factory.mktemp("tiny-3-layers-gpu")
    fixtures.hf_qwen3_moe(path, seed=5, num_hidden_layers=3)
    return path


def test_streamed_prefill_never_overwrites_a_buffer_in_use(three_layers, monkeypatch):
    """Random GPU delays before each layer's expert compute: a refill that did not wait for
    the layer reading the buffer would corrupt the result."""
    import random

    from freetoken.moe import prefill

    path = three_layers
    rng = random.Random(0)
    real = prefill.moe_gpu.experts_from_slots

    def delayed(*args, **kwargs):
        torch.cuda._sleep(
            rng.randrange(0, 2_000_000)
        )  # up to ~1 ms of spinning on the compute stream
        return real(*args, **kwargs)

    resident = make_engine(path, device="cuda", policy="resident")
    streamed = make_engine(path, device="cuda", policy="lru-pcie", slots=20)
    assert streamed.model.model.layers[0].mlp.experts.backend.streamer is not None
    monkeypatch.setattr(prefill.moe_gpu, "experts_from_slots", delayed)
    for trial in range(12):
        prompt = [rng.randrange(500) for _ in range(rng.randrange(40, 160))]
        ref = full_logits(resident, prompt)
        got = full_logits(streamed, prompt)
        assert float((got - ref).norm() / ref.norm()) <= 1e-5, trial
