"""Adaptive's tuner driven by the engine as served: captured steps launched ahead."""

from __future__ import annotations

import pytest

from tests.runtime.engine_util import generate, make_engine


@pytest.mark.gpu
def test_adaptive_measures_when_steps_are_launched_ahead(tiny_model, monkeypatch):
    """With decode ahead a step is launched right behind the one before, so the first
    interval after a prefill is a fraction of a step's. Once that seeded the running step
    time, every later step was dropped as idle time and the chooser never made a visit
    (through the server on the H200: no move in 1,500 steps)."""
    from freetoken.moe import tuning

    monkeypatch.setattr(tuning, "EXPLORE_AFTER", 16)
    monkeypatch.setattr(tuning, "DUTY", 1.0)
    path, _ = tiny_model
    engine = make_engine(
        path,
        policy="adaptive",
        slots=9,
        device="cuda",
        graphs="capture",
        device_cache="on",
        overlap=True,
    )
    backend = engine.model.model.layers[0].mlp.experts.backend
    try:
        moves = backend.tuner.moves
        for _ in range(3):
            generate(engine, [[5, 6, 7, 8]], 48)
        assert engine.ahead_steps > 0  # the steps did run ahead
        assert backend.tuner.moves > moves and backend.tuner.modes.means
    finally:
        if backend.lane is not None:
            backend.lane.stop()
