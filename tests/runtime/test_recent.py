"""The expert cache's recent window: the last few hundred tokens, not the totals."""

from __future__ import annotations

from freetoken.runtime.recent import Recent


def test_the_window_spans_the_samples_kept():
    r = Recent(every=10, keep=3)
    assert r.window() is None
    for tokens, hits, misses in [(0, 0, 0), (10, 50, 50), (20, 140, 60), (30, 230, 70)]:
        assert r.due(tokens)
        r.sample(tokens, {"hits": hits, "misses": misses})
    assert not r.due(35)
    # the first sample has left the window: 20 tokens, 180 hits, 20 misses
    assert r.window() == {"tokens": 20, "hit_rate": 0.9, "misses_per_token": 1.0}


def test_no_cache_no_samples():
    r = Recent()
    r.sample(100, None)
    assert r.window() is None
