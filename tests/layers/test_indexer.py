"""The lightning indexer's math: its scores against DeepSeek-V4's scorer in transformers,
the top-k of visible keys (fewer visible than k: -1), and a prefill's choice taken a block
of queries at a time equal to all at once."""

from __future__ import annotations

import torch

from freetoken.layers import indexer


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
    q, w, keys = torch.randn(12, 3, 8, generator=g), torch.randn(12, 3), torch.randn(20, 8)
    seen = torch.arange(9, 21)
    whole = indexer.prefix_top_k(q, w, keys, 5, seen)
    monkeypatch.setattr(indexer, "SCORE_BUDGET", 3 * 20 * 2)  # two queries a block
    assert torch.equal(indexer.prefix_top_k(q, w, keys, 5, seen), whole)
    assert bool((whole < seen[:, None]).all())
