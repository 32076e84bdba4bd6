"""Settings read from the environment: the think levels' budgets."""

from __future__ import annotations

import pytest

from freetoken import config


def test_think_budgets_are_level_token_pairs():
    assert config.load({}).think_budgets == {"low": 1024, "medium": 4096, "high": 16384}
    cfg = config.load({"FREETOKEN_THINK_BUDGETS": "low=10, max=0"})
    assert cfg.think_budgets == {"low": 10, "max": 0}
    with pytest.raises(config.ConfigError, match="FREETOKEN_THINK_BUDGETS"):
        config.load({"FREETOKEN_THINK_BUDGETS": "tiny=5"})
