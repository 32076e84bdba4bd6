from __future__ import annotations

import time

import pytest
import torch

from freetoken.runtime.sampling import (
    SamplingParams,
    apply_penalties,
    draw,
    make_generator,
    sample,
)


def test_greedy_is_argmax():
    logits = torch.tensor([0.1, 3.0, -1.0, 2.9])
    assert sample(logits, [], SamplingParams(temperature=0), 64, None) == 1


def test_seed_makes_sampling_reproducible():
    logits = torch.randn(500)
    p = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=7)
    a = [sample(logits, [], p, 64, g) for g in [make_generator(p)] for _ in range(20)]
    g2 = make_generator(p)
    b = [sample(logits, [], p, 64, g2) for _ in range(20)]
    assert a == b
    assert len(set(a)) > 1


def test_top_k_one_is_greedy_and_top_k_limits_choices():
    logits = torch.randn(100)
    best = int(torch.argmax(logits))
    p = SamplingParams(temperature=1.5, top_k=1, seed=1)
    g = make_generator(p)
    assert {sample(logits, [], p, 64, g) for _ in range(20)} == {best}
    p3 = SamplingParams(temperature=5.0, top_k=3, top_p=1.0, seed=2)
    g = make_generator(p3)
    allowed = set(torch.topk(logits, 3).indices.tolist())
    assert {sample(logits, [], p3, 64, g) for _ in range(100)} <= allowed


def test_top_p_and_min_p_cut_the_tail():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    p = SamplingParams(temperature=1.0, top_k=0, top_p=0.7, seed=3)
    g = make_generator(p)
    assert {sample(logits, [], p, 64, g) for _ in range(200)} == {0, 1}
    p = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.5, seed=3)
    g = make_generator(p)
    assert {sample(logits, [], p, 64, g) for _ in range(200)} == {0, 1}


def test_penalties_push_repeated_tokens_down():
    logits = torch.tensor([2.0, -2.0, 1.0])
    out = apply_penalties(logits, [0, 1, 0], SamplingParams(repeat_penalty=2.0), 64)
    assert out.tolist() == [1.0, -4.0, 1.0]
    out = apply_penalties(
        logits, [0, 0, 2], SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), 64
    )
    assert out.tolist() == [2.0 - 1.0 - 0.25, -2.0, 1.0 - 0.5 - 0.25]
    # repeat_last_n limits the window; 0 disables
    out = apply_penalties(logits, [0, 2], SamplingParams(repeat_penalty=2.0, repeat_last_n=1), 64)
    assert out.tolist() == [2.0, -2.0, 0.5]
    assert (
        apply_penalties(
            logits, [0], SamplingParams(repeat_penalty=2.0, repeat_last_n=0), 64
        ).tolist()
        == logits.tolist()
    )


@pytest.mark.parametrize("seed", range(6))
def test_the_gpu_penalty_is_the_cpu_one_on_every_logit(seed):
    """The scatter over the vocabulary (a GPU's: no host sync) gives each logit exactly what
    the CPU's rewrite of the seen tokens gives, for every mix of penalties."""
    from freetoken.runtime import sampling

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(300, generator=g) * 4
    logits[torch.randint(0, 300, (5,), generator=g)] = float("-inf")
    recent = torch.randint(0, 300, (int(torch.randint(1, 80, (1,), generator=g)),), generator=g)
    for p in (
        SamplingParams(repeat_penalty=1.3),
        SamplingParams(repeat_penalty=0.8, frequency_penalty=0.4),
        SamplingParams(repeat_penalty=1.0, presence_penalty=0.7, frequency_penalty=-0.2),
    ):
        dense = sampling.penalize_rows(logits[None], [recent.tolist()], p, 4096)[0]
        window = recent[-p.repeat_last_n :]
        assert torch.equal(dense, sampling._penalize_seen(logits, window, p))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_penalties_on_a_gpu_equal_the_cpus():
    logits = torch.randn(151936, generator=torch.Generator().manual_seed(0))
    history = list(range(0, 5000, 7)) * 2
    p = SamplingParams(repeat_penalty=1.1, frequency_penalty=0.3, presence_penalty=0.1)
    on_gpu = apply_penalties(logits.cuda(), history, p, 4096)
    assert torch.equal(on_gpu.cpu(), apply_penalties(logits, history, p, 4096))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7, repeat_penalty=1.1),  # Ollama's defaults
        SamplingParams(temperature=1.5, top_p=1.0, top_k=100000),  # a threshold, no sort
        SamplingParams(temperature=1.0, top_p=0.95, top_k=5000),  # sorted
        SamplingParams(temperature=0.0, frequency_penalty=0.5),
    ],
    ids=["defaults", "large top_k", "sorted", "greedy"],
)
def test_a_draw_on_a_gpu_never_waits_for_it(params):
    """With the next step launched before a token is read (runtime/overlap.py), a draw that
    waits for the device stalls the whole step: CUDA's sync check must not fire, and a draw
    queued behind a long kernel returns before it ends (a copy from pageable memory waits
    for the stream without the check seeing it)."""
    logits = torch.randn(151936, device="cuda")
    history = list(range(0, 700, 7))
    draw(logits, history, params, 4096, None)  # first use: kernels compile
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        torch.cuda._sleep(1_000_000_000)  # about half a second of the GPU's clock
        t0 = time.perf_counter()
        token = draw(logits, history, params, 4096, make_generator(params, "cuda"))
        took = time.perf_counter() - t0
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert 0 <= int(token) < logits.numel()
    assert took < 0.1, f"the draw waited {took:.3f} s for the device"


def test_from_options_uses_ollama_defaults():
    p = SamplingParams.from_options({"temperature": 0.2, "stop": ["x"]})
    assert (p.temperature, p.top_k, p.top_p, p.repeat_last_n, p.stop) == (0.2, 40, 0.9, 64, ("x",))


def _frequencies(logits, p, n=4000, seed=0):
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(logits.numel())
    for _ in range(n):
        counts[sample(logits, [], p, 4096, g)] += 1
    return counts / n


def test_a_large_top_k_keeps_its_tokens_by_threshold(monkeypatch):
    """Past SORTED_TOP_K the k largest are kept by the k-th largest value, unsorted: the
    same distribution as the sorted path, and nothing outside the k."""
    from freetoken.runtime import sampling

    monkeypatch.setattr(sampling, "SORTED_TOP_K", 8)
    V = 50
    logits = torch.linspace(-2.0, 2.0, V)[
        torch.randperm(V, generator=torch.Generator().manual_seed(1))
    ]
    for k in (30, 0):
        p = SamplingParams(temperature=1.0, top_k=k, top_p=1.0)
        freq = _frequencies(logits, p, n=8000)
        kept = logits >= torch.topk(logits, k).values[-1] if k else torch.ones(V, dtype=torch.bool)
        assert freq[~kept].sum() == 0
        expect = torch.softmax(logits.masked_fill(~kept, float("-inf")), dim=-1)
        assert (freq - expect).abs().sum() < 0.12  # total variation over 8000 draws
    # with top_p the threshold path sorts what it kept: the top_p prefix of the top k
    p = SamplingParams(temperature=1.0, top_k=30, top_p=0.5)
    freq = _frequencies(logits, p, n=2000)
    order = torch.argsort(logits, descending=True)
    probs = torch.softmax(logits[order[:30]], dim=-1)
    inside = int((torch.cumsum(probs, 0) - probs < 0.5).sum())
    assert freq[order[inside:]].sum() == 0 and freq[order[:inside]].sum() == 1


def test_sampling_stays_on_the_logits_device_until_read():
    logits = torch.tensor([0.0, 3.0, 1.0])
    from freetoken.runtime.sampling import draw

    token = draw(logits, [], SamplingParams(temperature=0.0), 4096, None)
    assert isinstance(token, torch.Tensor) and token.device == logits.device and int(token) == 1
