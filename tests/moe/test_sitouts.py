"""The modes that sit out measurements (moe/sitouts.py)."""

from __future__ import annotations

from freetoken.moe.sitouts import SitOuts


def test_a_turn_counts_once_the_asks_add_up_to_a_wait():
    sits = SitOuts()
    sits.set("device", 2)
    sits.at_least("layers", 1)
    sits.at_least("device", 1)  # never fewer than it had
    assert "device" in sits and "layers" in sits and "split" not in sits
    for _ in range(3):  # the gate's asks, 64 steps apart: not yet a wait of 256
        sits.turn(64, 256)
    assert sits.left == {"device": 2, "layers": 1}
    sits.turn(64, 256)
    assert sits.left == {"device": 1}
    sits.turn(256, 256)
    assert sits.left == {} and "device" not in sits
