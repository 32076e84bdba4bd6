"""Settings read from the environment: the think levels' budgets, the split of a miss by rows,
the placements adaptive may serve from, the parts of the lane's team it measures."""

from __future__ import annotations

import pytest

from freetoken import config


def test_think_budgets_are_level_token_pairs():
    assert config.load({}).think_budgets == {"low": 1024, "medium": 4096, "high": 16384}
    cfg = config.load({"FREETOKEN_THINK_BUDGETS": "low=10, max=0"})
    assert cfg.think_budgets == {"low": 10, "max": 0}
    with pytest.raises(config.ConfigError, match="FREETOKEN_THINK_BUDGETS"):
        config.load({"FREETOKEN_THINK_BUDGETS": "tiny=5"})


def test_split_rows_is_off_auto_or_a_fraction():
    assert config.load({}).split_rows == 0.0  # off unless asked for
    assert config.load({"FREETOKEN_SPLIT_ROWS": "auto"}).split_rows is None
    assert config.load({"FREETOKEN_SPLIT_ROWS": "0.375"}).split_rows == 0.375
    for bad in ("1", "-0.1", "half"):
        with pytest.raises(config.ConfigError, match="FREETOKEN_SPLIT_ROWS"):
            config.load({"FREETOKEN_SPLIT_ROWS": bad})


def test_adaptive_modes_are_all_or_a_list_of_placements():
    from freetoken.moe.policy import Mode

    assert set(config.ADAPTIVE_MODES) == {str(m) for m in Mode}  # the names kept below moe
    assert config.load({}).adaptive_modes is None
    cfg = config.load({"FREETOKEN_ADAPTIVE_MODES": "Split, device"})
    assert cfg.adaptive_modes == ("split", "device")
    for bad in ("", "split,fast", "resident"):
        with pytest.raises(config.ConfigError, match="FREETOKEN_ADAPTIVE_MODES"):
            config.load({"FREETOKEN_ADAPTIVE_MODES": bad})


def test_lane_teams_are_distinct_parts_of_the_team():
    assert config.load({}).lane_teams == (1.0,)  # the whole team, as measured fastest
    assert config.load({"FREETOKEN_LANE_TEAMS": "1,0.5"}).lane_teams == (1.0, 0.5)
    assert config.load({"FREETOKEN_LANE_TEAMS": "0.5"}).lane_teams == (0.5,)
    assert config.load({"FREETOKEN_LANE_TEAMS": "1, 0.25,"}).lane_teams == (1.0, 0.25)
    for bad in ("", "0", "1.5", "1,1", "half"):
        with pytest.raises(config.ConfigError, match="FREETOKEN_LANE_TEAMS"):
            config.load({"FREETOKEN_LANE_TEAMS": bad})
