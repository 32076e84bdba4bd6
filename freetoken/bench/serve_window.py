"""What a window of the server's counters says (`freetoken bench serve`): the difference of
two /api/cache snapshots around a row's answers, and the bound from its own misses."""

from __future__ import annotations

from typing import Any


def window(before: dict, after: dict) -> dict[str, Any]:
    """Hits and misses per token and a step, between two /api/cache snapshots."""
    c0, c1 = before.get("cache") or {}, after.get("cache") or {}
    tokens = (after.get("decoded") or 0) - (before.get("decoded") or 0)
    steps = (after.get("steps") or 0) - (before.get("steps") or 0)
    if not c1 or tokens <= 0 or steps <= 0:
        return {"placement": after.get("placement")}
    hits, misses = c1["hits"] - c0.get("hits", 0), c1["misses"] - c0.get("misses", 0)
    guessed = (after.get("guessed") or 0) - (before.get("guessed") or 0)
    return {
        "hit_rate": hits / max(hits + misses, 1),
        "misses_per_token": misses / tokens,
        "guessed_per_token": guessed / tokens,
        "misses_per_step": misses / steps,
        "placement": after.get("placement"),
        # adaptive's moves in the window: each a visit's edge, and the graphs recaptured
        "moves": (after.get("placement_moves") or 0) - (before.get("placement_moves") or 0),
        **lane_window(
            before.get("lane") or {}, after.get("lane") or {}, steps, after.get("expert_bytes")
        ),
        **engine_window(before, after, steps),
    }


def served_in(stats: dict, streams: int) -> str | None:
    """The placement a step of `streams` sequences runs in at the window's end: its size's
    own where adaptive keeps one (a mode found slower at that size only), else the mode."""
    own = stats.get("placement_by_batch") or {}  # JSON: the sizes are strings
    return own.get(str(streams)) or stats.get("placement")


def engine_window(before: dict, after: dict, steps: int) -> dict[str, Any]:
    """The engine thread's milliseconds a step not waiting for the device, and the share of
    steps launched before the last one's tokens were read."""
    if after.get("busy_ns") is None:
        return {}
    busy = after["busy_ns"] - (before.get("busy_ns") or 0)
    busy -= after["wait_ns"] - (before.get("wait_ns") or 0)
    ahead = after["ahead_steps"] - (before.get("ahead_steps") or 0)
    win = {"host_ms": busy / steps / 1e6, "ahead": ahead / steps}
    r0, r1 = before.get("ahead_refused") or {}, after.get("ahead_refused") or {}
    refused = {k: n - r0.get(k, 0) for k, n in r1.items() if n > r0.get(k, 0)}
    if refused:  # the commonest reason a step did not run ahead, and its share of the steps
        why = max(refused, key=refused.__getitem__)
        win["not_ahead"] = f"{why} {refused[why] / steps:.2f}"
    return win


def lane_window(
    before: dict, after: dict, steps: int, expert_bytes: int | None = None
) -> dict[str, Any]:
    """The CPU lane's requests a step and its milliseconds a request over the window (the
    runner reports totals: served, and the mean time of all it served), the members that ran
    a pass of its kernel on average (adaptive may cut its team), and with `expert_bytes` the
    rate it read experts at, each route a whole expert: near host DRAM's read rate the lane
    is bound by memory, not by its hand-offs (with a miss split by its rows the lane reads
    less than that, so the figure is an upper bound)."""
    served = (after.get("served") or 0) - (before.get("served") or 0)
    if served <= 0:
        return {}

    def total(side: dict, per_unit: str, units: str = "served") -> float:
        return (side.get(units) or 0) * (side.get(per_unit) or 0.0)

    busy_us = total(after, "cpu_us_per_request") - total(before, "cpu_us_per_request")
    out = {"lane_per_step": served / steps, "lane_ms": busy_us / served / 1e3}
    passes = (after.get("passes") or 0) - (before.get("passes") or 0)
    if passes > 0:
        members = ("members_per_pass", "passes")
        out["lane_team"] = (total(after, *members) - total(before, *members)) / passes
    routes = total(after, "routes_per_request") - total(before, "routes_per_request")
    if expert_bytes and busy_us > 0:
        out["lane_gbps"] = routes * expert_bytes / (busy_us * 1e3)
    return out


def bound(stats: dict, win: dict, streams: int, dense_ms: float | None) -> float | None:
    """Tokens a second the bound allows a step of `streams` tokens with the window's misses:
    a miss at S / (B_P + B_H) from the measured bandwidths the server's split started from
    (its online fit folds host round trips in, which the bound leaves out)."""
    b_p, b_h, size = stats.get("b_p_gbps"), stats.get("b_h_gbps"), stats.get("expert_bytes")
    if dense_ms is None or not b_p or not b_h or not size or "misses_per_step" not in win:
        return None
    per_miss = size / ((b_p + b_h) * 1e9) * 1e3  # ms
    return streams * 1e3 / (dense_ms + win["misses_per_step"] * per_miss)


def miss_ms(win: dict, streams: int, agg_tok_s: float | None, dense_ms: float | None):
    """What a miss cost the window's step: its time over T_dense, a miss. The bound prices
    one at S / (B_P + B_H); a fetch kernel ahead of the expert kernels made it ~0.22 ms at four
    streams (12 layers, H100), the fused fetch 0.13."""
    misses = win.get("misses_per_step")
    if not misses or not agg_tok_s or dense_ms is None:
        return None
    return (streams * 1e3 / agg_tok_s - dense_ms) / misses


def share_arms(stats: dict, streams: int) -> dict[str, Any]:
    """Adaptive's share tuner as the window ended, at `streams` sequences a step: the share of
    misses fetched, and each share's steps and mean step ms. Split's rows differ most by it:
    through the server at 12 layers (H100) one stream sent 1.85 requests a step to the CPU
    lane at 0.91 of the bound and 0.01 at 0.77, with as many misses."""
    tuner = stats.get("pcie_share") or {}
    return {"share": tuner.get("share"), **((tuner.get("by_batch") or {}).get(str(streams)) or {})}
