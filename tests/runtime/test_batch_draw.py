"""Rows drawn together draw what each draws alone, in the rows' order, with mixed options."""

from __future__ import annotations

import pytest
import torch

from freetoken.runtime import batch_draw, sampling
from freetoken.runtime.sampling import SamplingParams

HOT = SamplingParams(temperature=0.7, repeat_penalty=1.1, frequency_penalty=0.2, seed=4)
GREEDY = SamplingParams(temperature=0.0, repeat_penalty=1.3, presence_penalty=0.5)
WIDE = SamplingParams(temperature=1.5, top_k=100000, top_p=1.0, seed=9)
UNSEEDED = SamplingParams(temperature=0.7, top_p=0.9)


def _devices():
    return ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _draws(device, rows, params, batched: bool, steps: int = 3):
    """Each row's tokens over a few steps, its history growing, from its own generator."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    g = torch.Generator().manual_seed(3)
    V = 5000
    scores = (3 * torch.randn(len(rows) + 2, V, generator=g)).to(device)
    # histories that share tokens with the likeliest ones, so the penalties change the draw
    top = torch.topk(scores, 8, dim=-1).indices.cpu().tolist()
    histories = [top[r][::2] + [r, r] for r in rows]
    gens = [sampling.make_generator(p, device) for p in params]
    out = []
    for _ in range(steps):
        if batched:
            tokens = batch_draw.draw_rows(scores, rows, histories, params, gens, 4096)
        else:
            tokens = [
                sampling.draw(scores[r], h, p, 4096, gen)
                for r, h, p, gen in zip(rows, histories, params, gens)
            ]
        got = [int(t) for t in tokens]
        for h, t in zip(histories, got):
            h.append(t)
        out.append(got)
    return out


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize(
    "rows, params",
    [
        ([0, 1, 2, 3], [HOT] * 4),  # every row, one group
        ([3, 0, 2], [GREEDY, HOT, GREEDY]),  # two groups, rows out of order
        ([1, 2, 3, 0], [HOT, WIDE, HOT, GREEDY]),  # a row that draws alone between them
    ],
    ids=["one group", "two groups", "mixed"],
)
def test_rows_drawn_together_draw_what_each_draws_alone(device, rows, params):
    assert _draws(device, rows, params, True) == _draws(device, rows, params, False)


@pytest.mark.parametrize("device", _devices())
def test_unseeded_rows_draw_from_their_own_top_k(device):
    """Without a seed no two runs agree; each token is still among its row's top k."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    scores = torch.randn(3, 5000, generator=torch.Generator().manual_seed(1)).to(device)
    tokens = batch_draw.draw_rows(scores, [0, 1, 2], [[], [], []], [UNSEEDED] * 3, [None] * 3, 64)
    for r, t in enumerate(tokens):
        assert int(t) in torch.topk(scores[r], UNSEEDED.top_k).indices.tolist()
