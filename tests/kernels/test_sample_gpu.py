"""The sampling kernels (kernels/sample_gpu.py) against the draw written out in torch: the
same token at the same uniform, for top-k, temperature, top-p and min-p, and for the wide
draw (a large k or none) in token order; in Triton's interpreter on host tensors, and on a
GPU through `sampling.draw`."""

from __future__ import annotations

import math

import pytest
import torch

from freetoken.kernels import sample_gpu
from freetoken.runtime import sampling
from tests.kernels.test_moe_gpu import DEVICES

# vocabulary, k, temperature, top_p, min_p: one block and several (the last one partly
# filled), k a power of two and not, each filter alone and together
CASES = [
    (3000, 40, 0.7, 0.9, 0.0),
    (9000, 1, 1.0, 1.0, 0.0),
    (9000, 64, 1.5, 1.0, 0.0),
    (9000, 17, 0.3, 0.5, 0.05),
    (12289, 40, 1.0, 0.0, 0.2),
]
# The interpreter sorts slowly (seconds a block of 512): small blocks, few draws there.
SMALL_BLOCK = 64


def cases(device):
    if device == "cuda":
        return [(c, 8) for c in CASES]
    return [((300, 16, 0.7, 0.9, 0.0), 3), ((500, 5, 0.3, 0.5, 0.05), 2)]


# vocabulary, k (0: none), temperature, min_p: every logit, a k that needs the radix
# select's three passes, a k of one, min_p with and without k, a vocabulary whose last
# block is partly filled
WIDE = [
    (151_643, 0, 1.5, 0.0),
    (151_643, 100_000, 1.5, 0.0),
    (50_000, 1, 1.0, 0.0),
    (50_000, 300, 0.7, 0.02),
    (9_001, 0, 1.0, 0.1),
]


def wide_cases(device):
    if device == "cuda":
        return [(c, 8) for c in WIDE]
    return [((1000, 0, 1.5, 0.0), 2), ((1000, 700, 1.5, 0.0), 2), ((777, 100, 0.7, 0.05), 2)]


@pytest.fixture
def small_blocks(request, monkeypatch):
    if request.node.callspec.params["device"] == "cpu":
        monkeypatch.setattr(sample_gpu, "BLOCK", SMALL_BLOCK)
        monkeypatch.setattr(sample_gpu, "WIDE_BLOCK", 256)


def reference(logits, k, temperature, top_p, min_p, u):
    """The draw at uniform u, in torch: the k largest in order, softmax at the temperature,
    the top-p prefix and min-p, then the first token whose cumulative mass passes u."""
    vals, idx = torch.topk(logits.cpu(), k)
    p = torch.softmax((vals - vals[0]) / temperature, dim=-1)
    keep = torch.ones(k, dtype=torch.bool)
    if 0 < top_p < 1:
        keep &= torch.cumsum(p, 0) - p < top_p
    if min_p > 0:
        keep &= p >= min_p * p[0]
    keep[0] = True
    q = torch.where(keep, p, 0.0)
    below = int(((torch.cumsum(q, 0) <= u * q.sum()) & keep).sum())
    return int(idx[min(below, int((q > 0).sum()) - 1)])


@pytest.mark.parametrize("device", DEVICES)
def test_kernels_draw_the_reference_token(device, small_blocks):
    for (V, k, temperature, top_p, min_p), draws in cases(device):
        g = torch.Generator().manual_seed(V + k)
        logits = (3 * torch.randn(V, generator=g)).to(device)
        for u in torch.rand(draws, generator=g).tolist():
            on = torch.tensor([u]).to(device)
            got = sample_gpu.top_k_draw(logits, k, temperature, top_p, min_p, on)
            assert int(got) == reference(logits, k, temperature, top_p, min_p, u), (V, k, u)


def wide_weights(logits, k, temperature, min_p):
    """The wide draw's weights in float64: the logits at or above the k-th largest (ties
    kept), exp((l - max) / T), zero below min_p of the likeliest's."""
    logits = logits.cpu().double()
    keep = torch.ones_like(logits, dtype=torch.bool)
    if 0 < k < logits.numel():
        keep &= logits >= torch.topk(logits, k).values[-1]
    z = (logits - logits.max()) / temperature
    if min_p > 0:
        keep &= z >= math.log(min_p)
    return torch.where(keep, torch.exp(z), 0.0)


# The kernels sum fp32 weights block by block (rounding ~1e-6 of the total, where torch's
# running fp32 sum over 151k tokens strays ~1e-5): a uniform this close to the boundary of two
# tokens' shares (of the total) may fall to either, as any fp32 sum may.
WIDE_TOLERANCE = 5e-6


def assert_wide_draw(w, u, got):
    """`got` is the token whose share of the running weight (token order) holds u, up to
    the fp32 sums' rounding: never a token of weight zero."""
    cdf = torch.cumsum(w, 0)
    total, at, slack = float(cdf[-1]), u * float(cdf[-1]), WIDE_TOLERANCE * float(cdf[-1])
    assert float(w[got]) > 0, (got, u)
    assert float(cdf[got] - w[got]) - slack <= at <= float(cdf[got]) + slack, (got, u, total)


def wide_reference(w, u):
    """The token in float64: the first whose running weight passes u times the total."""
    cdf = torch.cumsum(w, 0)
    below = int((cdf <= u * cdf[-1]).sum())
    return min(below, int(torch.nonzero(w > 0).max()))


@pytest.mark.parametrize("device", DEVICES)
def test_wide_draw_draws_the_reference_token(device, small_blocks):
    for (V, k, temperature, min_p), draws in wide_cases(device):
        g = torch.Generator().manual_seed(V + k)
        logits = (3 * torch.randn(V, generator=g)).to(device)
        w = wide_weights(logits, k, temperature, min_p)
        for u in torch.rand(draws, generator=g).tolist():
            got = sample_gpu.draw(logits, k, temperature, 1.0, min_p, torch.tensor([u]).to(device))
            assert_wide_draw(w, u, int(got))


@pytest.mark.parametrize("device", DEVICES)
def test_wide_draw_rows_in_one_launch(device, small_blocks):
    """Rows drawn in one launch each draw the reference token at their own uniform, and
    none below the k-th largest logit (the near-uniform routing regime's options: a high
    temperature, a k of most of the vocabulary, many rows)."""
    V, k, temperature = (1000, 600, 1.5) if device == "cpu" else (151_643, 100_000, 1.5)
    g = torch.Generator().manual_seed(3)
    logits = 2 * torch.randn(V, generator=g)
    n = 8 if device == "cpu" else 512
    u = torch.rand(n, generator=g)
    rows = logits.expand(n, V).contiguous().to(device)
    drawn = sample_gpu.draw(rows, k, temperature, 1.0, 0.0, u.to(device)).cpu()
    kth = torch.topk(logits, k).values[-1]
    assert bool((logits[drawn] >= kth).all())
    w = wide_weights(logits, k, temperature, 0.0)
    for x, got in zip(u.tolist(), drawn.tolist()):
        assert_wide_draw(w, x, got)
    # only a draw at a boundary may differ from the float64 reference: a few in 512
    same = sum(got == wide_reference(w, x) for x, got in zip(u.tolist(), drawn.tolist()))
    assert same >= n - max(1, n // 50)


@pytest.mark.parametrize("device", DEVICES)
def test_wide_draw_masked_and_infinite_logits(device, small_blocks):
    """Ruled-out tokens (-inf) are never drawn; an infinite or NaN logit takes the draw."""
    logits = torch.full((1000,), float("-inf"))
    logits[[7, 500, 999]] = torch.tensor([1.0, 2.0, 0.5])
    drawn = {
        int(sample_gpu.draw(logits.to(device), 0, 1.0, 1.0, 0.0, torch.tensor([u]).to(device)))
        for u in (0.0, 0.5, 0.999)
    }
    assert drawn <= {7, 500, 999} and 500 in drawn
    for bad in (float("inf"), float("nan")):
        logits[123] = bad
        got = sample_gpu.draw(logits.to(device), 200, 0.8, 1.0, 0.0, torch.tensor([0.7]).to(device))
        assert int(got) == 123


def test_takes_sorted_top_k_and_wide_draws_only():
    """The kernels draw a sorted top-k, or every candidate top_p keeps; a large k with a
    top_p under 1 needs the candidates in order of likelihood and stays with torch."""
    assert sample_gpu.takes(40, 151_643, 0.9)
    assert sample_gpu.takes(100_000, 151_643, 1.0) and sample_gpu.takes(0, 151_643, 1.0)
    assert not sample_gpu.takes(1000, 151_643, 0.95) and not sample_gpu.takes(0, 151_643, 0.5)


@pytest.mark.parametrize("device", DEVICES)
def test_rows_drawn_in_one_launch_draw_what_each_draws_alone(device, small_blocks):
    """A batch's rows with the same options take one launch of each kernel: each row's
    token is the one it draws alone at its own uniform."""
    (V, k, temperature, top_p, min_p), _ = cases(device)[0]
    g = torch.Generator().manual_seed(11)
    logits = (3 * torch.randn(3, V, generator=g)).to(device)
    u = torch.rand(3, generator=g)
    together = sample_gpu.top_k_draw(logits, k, temperature, top_p, min_p, u.to(device))
    assert together.shape == (3,)
    want = [reference(logits[i], k, temperature, top_p, min_p, float(u[i])) for i in range(3)]
    assert together.tolist() == want


@pytest.mark.parametrize("device", DEVICES)
def test_masked_and_infinite_logits(device, small_blocks):
    """Tokens a grammar ruled out (-inf) are never drawn, even where fewer than k remain;
    an infinite or NaN logit takes the draw, as torch's guard does."""
    logits = torch.full((300,), float("-inf"))
    logits[[7, 200, 299]] = torch.tensor([1.0, 2.0, 0.5])
    on = logits.to(device)
    drawn = {int(sample_gpu.top_k_draw(on, 40, 1.0, 1.0, 0.0, torch.tensor([u]).to(device)))
             for u in (0.0, 0.999)}  # fmt: skip
    assert drawn <= {7, 200, 299} and 200 in drawn
    for bad in (float("inf"), float("nan")):
        logits[123] = bad
        got = sample_gpu.top_k_draw(
            logits.to(device), 40, 0.8, 0.9, 0.0, torch.tensor([0.7]).to(device)
        )
        assert int(got) == 123


@pytest.mark.gpu
def test_draw_on_a_gpu_takes_the_kernels():
    """`sampling.draw` on CUDA: the kernels' token at the uniform its generator gives."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    logits = 3 * torch.randn(151_936, device="cuda")
    p = sampling.SamplingParams(temperature=0.7, top_k=40, top_p=0.9, seed=5)
    for step in range(4):
        gen = sampling.make_generator(p, "cuda")
        for _ in range(step):
            torch.rand(1, device="cuda", generator=gen)
        u = float(torch.rand(1, device="cuda", generator=gen))
        gen = sampling.make_generator(p, "cuda")
        for _ in range(step):
            torch.rand(1, device="cuda", generator=gen)
        got = int(sampling.draw(logits, [], p, 4096, gen))
        assert got == reference(logits, 40, 0.7, 0.9, 0.0, u)


def test_the_load_compiles_every_form_of_k(monkeypatch):
    """Triton compiles k = 1, a multiple of 16 and any other k as three kernels: the warm-up
    draws one of each through both kernel families (Ollama's default 40 among the 'other'
    form), so no first answer compiles one."""
    seen: list[tuple[str, int]] = []
    monkeypatch.setattr(sample_gpu, "top_k_draw", lambda l, k, *a: seen.append(("top", k)))
    monkeypatch.setattr(sample_gpu, "wide_draw", lambda l, k, *a: seen.append(("wide", k)))
    sample_gpu.warm_up(151_643, torch.device("cpu"))

    def form(k):
        return "one" if k == 1 else "16" if k % 16 == 0 else "other"

    for family, most in (("top", sample_gpu.MAX_K), ("wide", 151_642)):
        ks = [k for f, k in seen if f == family and k > 0]
        assert all(k <= most for k in ks)
        want = {"16", "other"} | ({"one"} if family == "top" else set())
        assert {form(k) for k in ks} == want, family
    assert ("wide", 0) in seen  # no top-k at all: its own form
    assert sample_gpu.warm_ks(40) == [1, 32, 40]
