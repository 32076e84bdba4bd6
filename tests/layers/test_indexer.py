"""The lightning indexer's math: its scores against DeepSeek-V4's scorer in transformers,
the top-k of visible keys (fewer visible than k: -1), a prefill's choice taken a block of
queries at a time equal to all at once, and the scores of listed pool rows — the kernel
against the torch code, by Triton's interpreter on the CPU and on a GPU."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from freetoken.layers import indexer

INTERPRET = (
    os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
)


def test_scores_match_deepseek_v4_scorer():
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4IndexerScorer

    cfg = DeepseekV4Config(
        hidden_size=32, index_n_heads=4, index_head_dim=16, num_hidden_layers=1, vocab_size=8
    )
    ref = DeepseekV4IndexerScorer(cfg)
    g = torch.Generator().manual_seed(0)
    x, q, keys = torch.randn(6, 32, generator=g), torch.randn(6, 4, 16), torch.randn(9, 16)
    want = ref(q[None], keys[None], x[None])[0]
    w = ref.weights_proj(x) * 4**-0.5
    assert torch.allclose(indexer.scores(q, w, keys), want, atol=1e-5)
    per_query = keys[None].expand(6, -1, -1)  # the decode form: keys per query
    assert torch.allclose(indexer.scores(q, w, per_query), want, atol=1e-5)


def test_top_k_keeps_the_best_visible_and_marks_the_rest():
    s = torch.tensor([[5.0, 1.0, 9.0, 7.0], [3.0, 8.0, 2.0, 0.0]])
    visible = torch.tensor([[True, True, False, True], [True, False, False, False]])
    assert indexer.top_k(s, visible, 2).tolist() == [[3, 0], [0, -1]]
    assert indexer.top_k(s, visible, 9).shape == (2, 4)


def test_prefix_top_k_in_blocks_equals_all_at_once(monkeypatch):
    g = torch.Generator().manual_seed(1)
    q, w, pool = torch.randn(12, 3, 8, generator=g), torch.randn(12, 3), torch.randn(30, 1, 8)
    rows, seen = torch.randperm(30, generator=g)[:20], torch.arange(9, 21)
    whole = indexer.prefix_top_k(q, w, pool, rows, 5, seen)
    want = indexer.top_k(
        indexer.scores(q, w, pool[rows, 0]), torch.arange(20)[None, :] < seen[:, None], 5
    )
    assert torch.equal(whole, want)
    monkeypatch.setattr(indexer, "SCORE_BUDGET", 3 * 20 * 2)  # two queries a block
    assert torch.equal(indexer.prefix_top_k(q, w, pool, rows, 5, seen), whole)
    assert bool((whole < seen[:, None]).all())


def _lists_case(n, h, d, S, L, dtype=torch.float32, device="cpu"):
    g = torch.Generator(device=device).manual_seed(n + S)
    q = torch.randn((n, h, d), generator=g, device=device).to(dtype)
    w = torch.randn((n, h), generator=g, device=device)
    pool = torch.randn((3 * S, 1, d + 5), generator=g, device=device).to(dtype)  # rows wider
    lists = torch.randint(0, 3 * S, (L, S), generator=g, device=device)
    lists[:, ::7] = -1  # holes
    which = torch.randint(0, L, (n,), generator=g, device=device)
    seen = torch.randint(0, S + 1, (n,), generator=g, device=device)
    return q, w, pool, lists, which, seen


def _check_list_scores(n, h, d, S, L, dtype=torch.float32, device="cpu", tol=1e-5):
    q, w, pool, lists, which, seen = _lists_case(n, h, d, S, L, dtype, device)
    keys = pool[..., :d]
    want = indexer.scores(q, w, keys[lists.clamp(min=0), 0][which])
    visible = (torch.arange(S, device=device)[None, :] < seen[:, None]) & (lists[which] >= 0)
    got = indexer._list_scores_kernel(q, w, pool, lists, which, seen)
    assert torch.equal(got == float("-inf"), ~visible)
    assert torch.allclose(got[visible], want[visible], rtol=tol, atol=tol)
    ref = indexer.list_scores(q.cpu(), w.cpu(), pool.cpu(), lists.cpu(), which.cpu(), seen.cpu())
    assert torch.allclose(ref, got.cpu(), rtol=tol, atol=tol)


# (n, heads, d, S, lists): one list each (decode), one list shared (a prefill's sequence),
# heads and widths that are not blocks
LIST_CASES = [(3, 4, 16, 70, 3), (5, 8, 24, 130, 1), (2, 20, 40, 64, 2)]


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and triton")
@pytest.mark.parametrize("n,h,d,S,L", LIST_CASES)
def test_list_scores_kernel_in_the_interpreter(n, h, d, S, L):
    _check_list_scores(n, h, d, S, L)


@pytest.mark.gpu
@pytest.mark.parametrize("n,h,d,S,L", LIST_CASES + [(64, 64, 128, 4096, 1)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 1e-2)])
def test_list_scores_kernel_matches_the_reference_on_a_gpu(n, h, d, S, L, dtype, tol):
    _check_list_scores(n, h, d, S, L, dtype, "cuda", tol)
