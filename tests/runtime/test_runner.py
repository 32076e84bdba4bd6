"""The real runner process over its Unix socket."""

from __future__ import annotations

import json
import time

import pytest

from tests.runtime.engine_util import runner_process


@pytest.fixture(scope="module")
def runner(tiny_model, tmp_path_factory):
    with runner_process(
        tiny_model[0], tmp_path_factory.mktemp("runner"), num_ctx=256, timeout=30
    ) as client:
        yield client


def _events(client, body):
    with client.stream("POST", "/completion", json=body) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line) for line in r.iter_lines() if line]


def test_generate_streams_content_then_done(runner):
    ev = _events(
        runner,
        {
            "kind": "generate",
            "prompt": "Hello",
            "raw": True,
            "options": {"temperature": 0, "num_predict": 12},
        },
    )
    assert ev[-1]["done"] and ev[-1]["done_reason"] == "length"
    assert ev[-1]["eval_count"] == 12 and ev[-1]["prompt_eval_count"] > 0
    assert all("content" in e for e in ev[:-1])


def test_greedy_is_deterministic_and_stop_strings_cut(runner):
    body = {
        "kind": "chat",
        "messages": [{"role": "user", "content": "hi"}],
        "options": {"temperature": 0, "num_predict": 30},
    }
    text = "".join(e.get("content", "") for e in _events(runner, body))
    assert text == "".join(e.get("content", "") for e in _events(runner, body))
    stop = text[5:8]
    ev = _events(runner, {**body, "options": {**body["options"], "stop": [stop]}})
    cut = "".join(e.get("content", "") for e in ev)
    assert cut == text[: text.find(stop)]
    assert ev[-1]["done_reason"] == "stop"


def test_bad_requests_get_400(runner):
    r = runner.post("/completion", json={"kind": "chat", "messages": [], "options": {"top_k": "x"}})
    assert r.status_code == 400 and "top_k" in r.json()["error"]
    r = runner.post(
        "/completion",
        json={"kind": "generate", "prompt": "x " * 400, "raw": True, "truncate": False},
    )
    assert r.status_code == 400 and "exceeds the context length" in r.json()["error"]
    r = runner.post("/completion", content=b"{nope")
    assert r.status_code == 400


def test_closing_the_stream_cancels_and_frees_pages(runner):
    body = {
        "kind": "generate",
        "prompt": "go",
        "raw": True,
        "options": {"temperature": 0.9, "num_predict": 200},
    }
    with runner.stream("POST", "/completion", json=body) as r:
        for _ in r.iter_lines():
            break
    deadline = time.time() + 10
    while time.time() < deadline:
        s = runner.get("/stats").json()
        # the pages it computed stay in the prefix cache, held by nothing else
        unheld = s["kv_pages_free"] + s["kv_pages_cached"]
        if s["running"] == 0 and s["waiting"] == 0 and unheld == s["kv_pages_total"]:
            break
        time.sleep(0.05)
    assert unheld == s["kv_pages_total"]


def test_concurrent_requests_all_finish(runner):
    import concurrent.futures as cf

    body = {
        "kind": "generate",
        "prompt": "abc",
        "raw": True,
        "options": {"temperature": 0, "num_predict": 16},
    }
    with cf.ThreadPoolExecutor(4) as ex:
        results = list(ex.map(lambda _: _events(runner, body), range(4)))
    texts = {"".join(e.get("content", "") for e in ev) for ev in results}
    assert len(texts) == 1  # same greedy output whatever the batching
    assert all(ev[-1]["eval_count"] == 16 for ev in results)


def test_a_second_turn_evaluates_only_what_is_new(runner):
    """The three-turn chat of an agent: each turn's done counts only the tokens it evaluated,
    the rest as cached, and answers as a request that reuses nothing does."""
    messages = [{"role": "system", "content": "You are terse. " * 20}]
    before: list[int] = []  # the token ids the last turn computed
    for i, turn in enumerate(("first question", "second question", "third")):
        messages.append({"role": "user", "content": turn})
        body = {
            "kind": "chat",
            "messages": messages,
            "options": {"temperature": 0, "num_predict": 8},
        }
        ev = _events(runner, body)
        fresh = _events(runner, {**body, "options": {**body["options"], "cache_prompt": False}})
        text = "".join(e.get("content", "") for e in ev)
        assert text == "".join(e.get("content", "") for e in fresh)
        done, total = ev[-1], fresh[-1]["prompt_eval_count"]
        assert fresh[-1]["prompt_cached_count"] == 0
        assert done["prompt_eval_count"] + done["prompt_cached_count"] == total
        prompt = done["context"][:total]
        same = next((j for j, (a, b) in enumerate(zip(before, prompt)) if a != b), len(before))
        # evaluated: what differs from the last turn, and at most the page it starts in
        assert done["prompt_eval_count"] <= total - same + 16
        assert i == 0 or done["prompt_cached_count"] > total // 2
        before = done["context"]
        messages.append({"role": "assistant", "content": text})


@pytest.fixture(scope="module", params=["off", "on"])
def cached_runner(request, tiny_model, tmp_path_factory):
    """A runner with an expert cache of 12 slots (in host memory on a machine without a GPU),
    its books kept on the host, or on the device for single streams ("on": the device is the
    CPU here, so the same ops run there).

    lru-pcie, so every route runs through the slots: adaptive would send a varying share of
    misses to the CPU kernel, whose fp32 sums differ in the last bits, and greedy text from
    a random-weight model can then diverge at a near-tie whatever the resize did."""
    import os

    env = {**os.environ, "FREETOKEN_EXPERT_SLOTS": "12", "FREETOKEN_DEVICE_CACHE": request.param}
    with runner_process(
        tiny_model[0],
        tmp_path_factory.mktemp("cached-runner"),
        num_ctx=256,
        timeout=60,
        num_parallel=4,
        options={"moe_policy": "lru-pcie"},
        env=env,
    ) as client:
        client.device_cache = request.param
        yield client


def test_resize_while_four_streams_run_fails_none(cached_runner):
    import concurrent.futures as cf

    body = {
        "kind": "generate",
        "prompt": "abc",
        "raw": True,
        "options": {"temperature": 0, "num_predict": 60},
    }
    ref = "".join(e.get("content", "") for e in _events(cached_runner, body))
    with cf.ThreadPoolExecutor(5) as ex:
        streams = [ex.submit(_events, cached_runner, body) for _ in range(4)]
        sizes = []
        for size in (8, 16, 10):
            time.sleep(0.05)
            # statistics are read while the steps run (with device-kept books: from their counts)
            assert cached_runner.get("/stats").json()["experts"]["cache"]["slots"] in (12, *sizes)
            r = cached_runner.post("/resize", json={"slots": size})
            assert r.status_code == 200, r.text
            sizes.append(r.json()["slots"])
        results = [f.result() for f in streams]
    assert sizes == [8, 16, 10]
    # a single stream again (its books back on the device where they are kept there)
    assert "".join(e.get("content", "") for e in _events(cached_runner, body)) == ref
    books = cached_runner.get("/stats").json()["experts"]["books"]
    assert books == ("device" if cached_runner.device_cache == "on" else "host")
    for ev in results:
        assert ev[-1]["done"] and ev[-1]["eval_count"] == 60
        assert (
            "".join(e.get("content", "") for e in ev) == ref
        )  # same greedy text whatever the size


def test_resize_below_the_floor_is_a_400_and_changes_nothing(cached_runner):
    before = cached_runner.get("/stats").json()["experts"]["cache"]["slots"]
    r = cached_runner.post("/resize", json={"slots": 3})
    assert r.status_code == 400 and "below the floor of 8" in r.json()["error"]
    assert cached_runner.get("/stats").json()["experts"]["cache"]["slots"] == before
    r = cached_runner.post("/resize", json={"size": "lots"})
    assert r.status_code == 400


def test_stats_show_the_caches_recent_window(cached_runner):
    body = {
        "kind": "generate",
        "prompt": "go",
        "raw": True,
        "options": {"temperature": 1.0, "seed": 1, "num_predict": 200},
    }
    for seed in (1, 2, 3):  # a random model may end an answer early
        _events(cached_runner, {**body, "options": {**body["options"], "seed": seed}})
    recent = cached_runner.get("/stats").json()["recent"]
    assert recent["tokens"] >= 64 and 0 <= recent["hit_rate"] <= 1
    assert recent["misses_per_token"] >= 0
