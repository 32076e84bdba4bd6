from __future__ import annotations

import torch

from freetoken.runtime.sampling import SamplingParams, apply_penalties, make_generator, sample


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


def test_from_options_uses_ollama_defaults():
    p = SamplingParams.from_options({"temperature": 0.2, "stop": ["x"]})
    assert (p.temperature, p.top_k, p.top_p, p.repeat_last_n, p.stop) == (0.2, 40, 0.9, 64, ("x",))
