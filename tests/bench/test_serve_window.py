"""The server's counters around a row (bench/serve_window.py)."""

from __future__ import annotations

import pytest

from freetoken.bench import serve_window


def test_the_window_is_the_difference_of_two_snapshots():
    before = {"cache": {"hits": 100, "misses": 50}, "decoded": 10, "steps": 10}
    after = {"cache": {"hits": 400, "misses": 150}, "decoded": 60, "steps": 35}
    before |= {"placement_moves": 3, "guessed": 10}
    after |= {"placement": "split", "placement_moves": 5, "guessed": 35}
    win = serve_window.window(before, after)
    assert win == {
        "hit_rate": 0.75,
        "misses_per_token": 2.0,
        "guessed_per_token": 0.5,
        "misses_per_step": 4.0,
        "placement": "split",
        "moves": 2,
    }


def test_the_bound_adds_the_bandwidths_of_both_paths():
    # 5 MB at 25 + 25 GB/s: 0.1 ms a miss; the split's fitted costs (host work folded in)
    # are not the bound's
    stats = {"b_p_gbps": 25.0, "b_h_gbps": 25.0, "expert_bytes": 5_000_000}
    stats |= {"pcie_ms_per_expert": 9.0, "cpu_ms_per_expert": 9.0}
    win = {"misses_per_step": 20.0}
    assert serve_window.bound(stats, win, 1, dense_ms=3.0) == pytest.approx(200.0)
    assert serve_window.bound(stats, win, 4, dense_ms=3.0) == pytest.approx(800.0)
    assert serve_window.bound(stats, win, 1, dense_ms=None) is None
    assert serve_window.bound({"b_p_gbps": 25.0}, win, 1, dense_ms=3.0) is None


def test_a_miss_costs_the_step_over_the_dense_step_over_its_misses():
    # four streams at 1,321 tok/s: 3.028 ms a step, 2.045 of it dense, 7.18 misses a step
    win = {"misses_per_step": 7.18}
    assert serve_window.miss_ms(win, 4, 1321.0, 2.045) == pytest.approx(0.1369, abs=1e-4)
    assert serve_window.miss_ms({"misses_per_step": 0.0}, 4, 1321.0, 2.045) is None
    assert serve_window.miss_ms(win, 4, None, 2.045) is None  # no rate: nothing to say
    assert serve_window.miss_ms(win, 4, 1321.0, None) is None  # no dense probe


def test_the_lanes_window_is_its_requests_and_their_time_between_snapshots():
    before = {"lane": {"served": 10, "cpu_us_per_request": 100.0}}
    after = {"lane": {"served": 30, "cpu_us_per_request": 300.0}}
    # 30 · 300 µs − 10 · 100 µs = 8 ms over the window's 20 requests in 40 steps
    assert serve_window.lane_window(before["lane"], after["lane"], 40) == {
        "lane_per_step": 0.5,
        "lane_ms": 0.4,
    }
    assert serve_window.lane_window({}, {}, 40) == {}  # no lane, or nothing sent to it


def test_the_lanes_team_is_its_members_a_pass_over_the_window():
    before = {"served": 10, "cpu_us_per_request": 100.0, "passes": 20, "members_per_pass": 8.0}
    after = {"served": 30, "cpu_us_per_request": 300.0, "passes": 60, "members_per_pass": 5.0}
    # 60 · 5 − 20 · 8 = 140 members over the window's 40 passes: a team cut to about half
    assert serve_window.lane_window(before, after, 40)["lane_team"] == pytest.approx(3.5)


def test_the_lanes_read_rate_is_its_routes_whole_experts_over_its_time():
    before = {"served": 10, "cpu_us_per_request": 100.0, "routes_per_request": 2.0}
    after = {"served": 30, "cpu_us_per_request": 300.0, "routes_per_request": 4.0}
    # 30 · 4 − 10 · 2 = 100 routes of 9.4 MB in 8 ms: 117.5 GB/s
    win = serve_window.lane_window(before, after, 40, expert_bytes=9_400_000)
    assert win["lane_gbps"] == pytest.approx(117.5)
    assert "lane_gbps" not in serve_window.lane_window(before, after, 40)  # size not known


def test_the_engines_window_is_its_host_time_and_steps_run_ahead():
    before = {"busy_ns": 1_000_000, "wait_ns": 400_000, "ahead_steps": 2}
    after = {"busy_ns": 51_000_000, "wait_ns": 30_400_000, "ahead_steps": 32}
    # (50 − 30) ms of the engine thread's own work over 40 steps; 30 of them ran ahead
    assert serve_window.engine_window(before, after, 40) == {"host_ms": 0.5, "ahead": 0.75}
    assert serve_window.engine_window({}, {}, 40) == {}  # a server that does not report them
    before["ahead_refused"] = {"batch": 1, "plan": 4}
    after["ahead_refused"] = {"batch": 9, "plan": 6, "cut": 2}
    assert serve_window.engine_window(before, after, 40)["not_ahead"] == "batch 0.20"


def test_a_rows_placement_is_the_one_its_stream_count_runs_in():
    """Where adaptive serves a size in a placement of its own, that size's row shows it, not
    the mode the other sizes run in (a window at one stream served in device read 'split')."""
    stats = {"placement": "split", "placement_by_batch": {"1": "device"}}
    assert serve_window.served_in(stats, 1) == "device"
    assert serve_window.served_in(stats, 4) == "split"
    assert serve_window.served_in({"placement": "layers"}, 1) == "layers"
    assert serve_window.served_in({}, 1) is None


def test_a_row_carries_the_share_tuners_arms_at_its_stream_count():
    stats = {
        "pcie_share": {
            "share": 0.75,
            "by_batch": {"1": {"step_ms": [1.5, 1.6, 1.7, 1.7, 1.8], "steps": [9, 9, 2, 300, 2]}},
        }
    }
    assert serve_window.share_arms(stats, 1) == {
        "share": 0.75,
        "step_ms": [1.5, 1.6, 1.7, 1.7, 1.8],
        "steps": [9, 9, 2, 300, 2],
    }
    assert serve_window.share_arms(stats, 4) == {"share": 0.75}  # no steps at four yet
    assert serve_window.share_arms({}, 1) == {"share": None}  # not adaptive
