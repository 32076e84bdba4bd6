"""Which mode each batch size serves, and where the modes were compared (moe/sizes.py)."""

from __future__ import annotations

from freetoken.moe.sizes import Sizes


def test_a_size_nothing_compared_at_is_asked_of_after_enough_steps():
    sizes = Sizes(new_size=3)
    assert not any(sizes.asks(4, False) for _ in range(5))  # nothing compared anywhere yet
    sizes.compared.add(1)
    assert not any(sizes.asks(1, False) for _ in range(5))
    assert [sizes.asks(4, False) for _ in range(6)] == [False, False, True] * 2
    assert not any(sizes.asks(2, True) for _ in range(5))  # a trial judges it
    sizes.compared.add(4)
    sizes.forget([4])
    assert [sizes.asks(4, False) for _ in range(3)] == [False, False, True]


def test_own_modes_are_dropped_with_their_size_or_once_they_are_the_mode_in_use():
    sizes = Sizes(new_size=3)
    sizes.restore({1: "device", 4: "split", 2: "layers"}, 8, ("device", "split"), "split")
    assert sizes.own == {1: "device"} and sizes.compared == {1, 8}
    assert sizes.mode_for(1, "split") == "device" and sizes.mode_for(4, "split") == "split"
    sizes.own[4] = "cache"
    sizes.drop(1, "split")
    assert sizes.own == {4: "cache"}
    sizes.drop(0, "cache")
    assert sizes.own == {}


def test_a_switch_keeps_the_old_mode_where_nothing_will_judge_it():
    sizes = Sizes(new_size=3)
    sizes.restore({2: "device", 8: "cache"}, 4, ("device", "split", "cache"), "split")
    sizes.compared.update({1, 16})
    # split served one and sixteen streams lately: a trial judges device there
    sizes.switch(1, "split", "device", [1, 16], apart=True)
    assert sizes.own == {4: "split", 8: "cache"}  # two serves device, the mode in use now
    assert sizes.compared == {1, 2, 4, 8, 16}
    sizes.switch(1, "device", "layers", [1], apart=False)
    assert sizes.compared == {1, 4, 8}  # asked of anew: no size serves apart from layers
