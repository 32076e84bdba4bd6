"""The prefix cache: its trie and reference counts, and the engine resuming from it."""

from __future__ import annotations

import random

import pytest
import torch

from freetoken.runtime.kv_cache import KVCache, PagePool
from freetoken.runtime.prefix_cache import Match, PrefixCache, divergence
from freetoken.runtime.sampling import SamplingParams
from freetoken.runtime.scheduler import Scheduler
from freetoken.runtime.sequence import Sequence
from tests.runtime.engine_util import full_logits, generate, make_engine

P = 4  # tokens a page in the unit tests


def _cache(pages: int = 32):
    pool = PagePool(pages)
    copies: list[tuple[int, int, int]] = []
    return pool, PrefixCache(pool, P, lambda s, d, r: copies.append((s, d, r))), copies


def _fill(cache: PrefixCache, pool: PagePool, tokens: list[int]) -> list[int]:
    """A sequence that computed `tokens` enters its pages, then ends."""
    pages = pool.alloc(-(-len(tokens) // P))
    cache.insert(tokens, pages, None, 0)
    pool.release(pages)
    return pages


def test_a_prefix_is_found_page_by_page_then_in_part():
    pool, cache, copies = _cache()
    tokens = list(range(100, 114))  # 3 full pages and 2 tokens
    held = _fill(cache, pool, tokens)
    assert cache.cached_pages == 3  # the partly filled page is not entered
    # the same start, then another token in the third page's second place
    query = tokens[:9] + [7, 7, 7]
    pages, cached, found = cache.acquire(query, len(query) - 1)
    assert found.pages == held[:2] and cached == 2 * P + 1
    assert copies == [(held[2], pages[2], 1)] and pages[2] not in held[:3]
    assert found.diverged == tuple(tokens[9:12])
    assert [pool.refs[p] for p in held[:3]] == [2, 2, 1]


def test_a_divergence_says_where_and_why():
    found = Match([], None, None, (3, 4))
    seq = Sequence([1, 2, 9, 9], SamplingParams(), 1, frozenset())
    seq.cached_tokens = 2
    text = {1: "a", 2: "b", 3: "c", 4: "d", 9: "x", 34: "cd"}
    decode = lambda ids: "".join(text[i] for i in ids)  # noqa: E731
    assert divergence(decode, seq, found) == (
        "2 of 4 prompt tokens reused; at token 2 the history differs (cached 'cd', now 'xx')"
    )
    seq.prompt_ids = [1, 2, 34]  # "cd" as one token: the same text, other ids
    assert "the same text tokenised differently" in divergence(decode, seq, found)


def test_the_last_token_is_never_taken_from_the_cache():
    pool, cache, copies = _cache()
    tokens = list(range(16))
    held = _fill(cache, pool, tokens)
    pages, cached, _ = cache.acquire(tokens, len(tokens) - 1)
    assert cached == 15 and pages[:3] == held[:3]
    assert copies == [(held[3], pages[3], 3)]  # the last page, all but its last token


def test_the_last_page_of_an_ended_sequence_is_found_in_part():
    pool, cache, copies = _cache()
    tokens = list(range(10))
    pages = pool.alloc(3)
    node = cache.insert(tokens, pages, None, 0)
    cache.insert_tail(tokens, pages, node)
    cache.insert_tail(tokens, pages, node)  # once
    pool.release(pages)
    assert cache.cached_pages == 3 and pool.refs[pages[2]] == 1
    got, cached, _ = cache.acquire(tokens + [1, 2], 11)
    assert cached == 10 and copies == [(pages[2], got[2], 2)]


def test_a_page_computed_twice_is_held_once():
    pool, cache, _ = _cache()
    tokens = list(range(12))
    a, b = pool.alloc(3), pool.alloc(3)
    cache.insert(tokens, a, None, 0)
    node = cache.insert(tokens, b, None, 0)
    assert b == a  # the second sequence now reads the first's pages
    pool.release(a)
    pool.release(b)
    assert pool.num_free == 32 - 3 and node.page == a[2]


def test_eviction_takes_least_recently_used_leaves_and_spares_pages_in_use():
    pool, cache, _ = _cache(pages=12)
    old = _fill(cache, pool, list(range(8)))
    new = _fill(cache, pool, [50 + t for t in range(8)])
    pages, _, _ = cache.acquire(list(range(8)) + [9], 8)  # uses `old`: it stays
    assert pages == old
    assert cache.evict(1) == 2  # all it may: the unused branch, leaf first
    assert all(pool.refs[p] == 0 for p in new) and cache.cached_pages == 2
    pool.release(pages)
    assert cache.evict(1) == 2 and pool.num_free == 12


def test_random_use_never_frees_a_page_in_use():
    """Sequences come, share prefixes, grow and end while the pool evicts under pressure:
    a page a live sequence holds is never free, and nothing leaks."""
    rng = random.Random(1)
    kv = KVCache.uniform(1, 40, P, 1, 2, torch.float32, torch.device("cpu"))
    cache = PrefixCache(kv.pool, P, kv.copy_page)
    sched = Scheduler(kv, max_running=3, chunk=12, prefix=cache)
    stems = [[rng.randrange(5) for _ in range(rng.randrange(1, 30))] for _ in range(4)]
    live: list[Sequence] = []
    reused = shrunk = 0
    for _ in range(600):
        before = cache.cached_pages
        if rng.random() < 0.3:
            ids = rng.choice(stems) + [rng.randrange(5) for _ in range(rng.randrange(1, 12))]
            seq = Sequence(ids, SamplingParams(), rng.randrange(1, 20), frozenset())
            sched.add(seq)
            live.append(seq)
        for seq, n in sched.schedule():
            reused += seq.num_cached > 0 and seq.num_cached == seq.cached_tokens
            seq.num_cached += n
            sched.cache_pages(seq)
            if seq.num_cached == seq.num_tokens:
                seq.output_ids.append(rng.randrange(5))
        for seq in [s for s in sched.running if len(s.output_ids) >= s.max_new_tokens]:
            sched.remove(seq)
            live.remove(seq)
        held: dict[int, int] = {}
        for seq in sched.running + list(sched.waiting):
            assert len(seq.pages) >= kv.pages_for(seq.num_cached)
            for p in seq.pages:
                held[p] = held.get(p, 0) + 1
        free = set(kv.pool.free_list)
        for p, n in held.items():
            assert p not in free and kv.pool.refs[p] == n + (p in cache.nodes)
        for p in cache.nodes:
            assert p not in free
        assert len(free | held.keys() | cache.nodes.keys()) == kv.pool.num_pages
        shrunk += cache.cached_pages < before
    assert reused > 20 and shrunk > 5  # prefixes were shared, and the pool evicted


@pytest.fixture(scope="module")
def engine(tiny_model):
    return make_engine(tiny_model[0], pages=64, page_size=4, prefix_cache=True)


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 200, (n,), generator=g).tolist()


def test_a_turn_resumed_from_the_cache_equals_a_full_prefill(engine):
    history = _prompt(37, 0)
    (first,) = generate(engine, [history], 6)
    assert first.cached_tokens == 0
    # the next turn: the whole first turn, then a new message
    turn = history + first.output_ids + _prompt(9, 1)
    (second,) = generate(engine, [turn], 1)
    # all the first turn computed (its last sampled token was never fed), the last page
    # partly filled
    assert second.cached_tokens == len(history) + 5
    (alone,) = generate(engine, [turn], 1, reuse=False)
    ref = full_logits(engine, turn)[-1]
    assert second.output_ids == alone.output_ids == [int(ref.argmax())]


def test_logits_from_a_partial_page_copy_equal_a_full_prefill(engine):
    base = _prompt(30, 2)
    generate(engine, [base], 1)
    edited = base[:21] + _prompt(6, 3)  # differs inside a page
    seen: list = []
    engine.scheduler.on_match = lambda seq, found: seen.append(found)
    try:
        (seq,) = generate(engine, [edited], 1)
    finally:
        engine.scheduler.on_match = None
    assert seq.cached_tokens == 21 and seen[0].partial is not None
    assert seq.output_ids == [int(full_logits(engine, edited)[-1].argmax())]


def test_sequences_sharing_a_prefix_give_the_same_tokens_as_alone(engine):
    system = _prompt(40, 4)
    prompts = [system + _prompt(5, 10 + i) for i in range(4)]
    alone = [generate(engine, [p], 8, reuse=False)[0].output_ids for p in prompts]
    generate(engine, [system + [1]], 1)
    together = generate(engine, prompts, 8)
    assert [s.output_ids for s in together] == alone
    assert all(s.cached_tokens >= 40 for s in together)
