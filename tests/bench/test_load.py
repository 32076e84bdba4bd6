"""`freetoken bench load`'s plan and summary: the served configuration is loaded `repeats`
times spread through the run, every other configuration once, and each row reports the
repeat with the median ratio to the raw reads around it."""

import pytest

from freetoken.bench import load


@pytest.mark.parametrize("pin", [True, False])
@pytest.mark.parametrize("repeats", [1, 2, 3, 5])
def test_the_served_load_repeats_spread_out(pin, repeats):
    plan = [name for name, _ in load.configs(pin, 8, repeats)]
    served = plan[0]
    assert served.startswith("as served") and plan.count(served) == repeats
    others = [n for n in plan if n != served]
    assert len(others) == len(set(others)) == (5 if pin else 3)
    # other loads between the served ones, not all at one end of the run: the disk drifts
    if repeats <= len(others) + 1:
        assert not any(a == b == served for a, b in zip(plan, plan[1:]))


def test_merge_keeps_the_median_repeat_and_the_spread():
    rows = [{"config": "a", "ratio_to_raw": r, "gbps": r} for r in (0.9, 0.7, 1.1)] + [
        {"config": "b", "ratio_to_raw": 0.5, "gbps": 0.5}
    ]
    a, b = load.merge(rows)
    assert (a["config"], a["ratio_to_raw"], a["ratio_min"], a["ratio_max"], a["repeats"]) == (
        "a",
        0.9,
        0.7,
        1.1,
        3,
    )
    assert b["ratio_to_raw"] == 0.5 and b["repeats"] == 1 and "ratio_min" not in b
