from __future__ import annotations

from freetoken.moe import elastic

GiB = 1 << 30
S = 100 << 20  # 100 MiB experts


def test_target_shrinks_to_give_the_headroom_back_and_never_below_the_floor():
    assert (
        elastic.target(100, 10, 100, free=GiB // 4, headroom=GiB, expert_bytes=S, grow_ok=False)
        == 92
    )
    assert elastic.target(12, 10, 100, free=0, headroom=GiB, expert_bytes=S, grow_ok=False) == 10
    assert elastic.target(10, 10, 100, free=0, headroom=GiB, expert_bytes=S, grow_ok=False) is None
    assert elastic.target(50, 10, 100, free=GiB, headroom=GiB, expert_bytes=S, grow_ok=True) is None


def test_target_grows_back_only_when_allowed_and_up_to_the_ceiling():
    assert (
        elastic.target(50, 10, 100, free=4 * GiB, headroom=GiB, expert_bytes=S, grow_ok=False)
        is None
    )
    assert (
        elastic.target(50, 10, 100, free=4 * GiB, headroom=GiB, expert_bytes=S, grow_ok=True) == 75
    )
    assert (
        elastic.target(95, 10, 100, free=40 * GiB, headroom=GiB, expert_bytes=S, grow_ok=True)
        == 100
    )


def test_watcher_shrinks_at_once_and_grows_with_hysteresis():
    state = {"free": 3 * GiB, "cap": 100}
    calls = []

    def resize(n):
        calls.append(n)
        state["cap"] = n

    w = elastic.Watcher(
        lambda: state["free"], lambda: state["cap"], 10, lambda: 100, GiB, S, resize
    )
    assert w.tick(0.0) is None  # plenty free, already at the ceiling
    state["free"] = GiB // 8  # another program took memory
    assert w.tick(0.25) == 91 and state["cap"] == 91
    state["free"] = 5 * GiB  # it went away again
    assert w.tick(0.5) is None and w.tick(2.0) is None  # not yet: hysteresis
    assert w.tick(3.6) == 100
    assert calls == [91, 100]
