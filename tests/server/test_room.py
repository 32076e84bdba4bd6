"""The room for a load, on made-up figures: fits, unloads idle models least recently used
first (only those whose memory helps), waits for busy ones, refuses with the numbers."""

from __future__ import annotations

import pytest

from freetoken.doctor.fit import HOST_SHARE, VRAM_SHARE, Needs
from freetoken.doctor.memory import Free
from freetoken.server.room import Footprint, Held, Room, TooLarge, make_room

GiB = 2**30


def gpu_needs(host: float, vram: float) -> Needs:
    return Needs(int(host * GiB), int(vram * GiB), GiB, GiB, GiB, on_gpu=True)


def free(host: float, vram: float | None) -> Free:
    """Free memory such that exactly `host` / `vram` GiB are usable after the shares."""
    return Free(
        int(host * GiB / HOST_SHARE) + 1,
        gpu=True,
        vram=None if vram is None else int(vram * GiB / VRAM_SHARE) + 1,
    )


def held(key: str, host: float, vram: float, idle=True, last=0.0, pending=(0, 0)) -> Held:
    holds = Footprint(int(host * GiB), int(vram * GiB))
    more = Footprint(int(pending[0] * GiB), int(pending[1] * GiB))
    return Held(key, holds, more, idle=idle, last_used=last)


def test_a_model_that_fits_beside_the_others_unloads_nothing():
    room = make_room("m", gpu_needs(10, 8), free(12, 9), [held("a", 30, 10)])
    assert room == Room(need=Footprint(10 * GiB, 8 * GiB))


def test_idle_models_make_room_least_recently_used_first():
    others = [held("new", 4, 4, last=3.0), held("old", 4, 4, last=1.0), held("mid", 4, 4, last=2.0)]
    room = make_room("m", gpu_needs(1, 10), free(20, 2), others)
    assert room.victims == ("old", "mid") and not room.wait


def test_only_models_whose_memory_helps_are_unloaded():
    # short of GPU memory only: a model on the CPU (no VRAM) stays however idle
    others = [held("cpu", 40, 0, last=0.0), held("gpu", 2, 6, last=5.0)]
    room = make_room("m", gpu_needs(1, 8), free(50, 3), others)
    assert room.victims == ("gpu",)


def test_busy_models_holding_the_memory_are_waited_for():
    room = make_room("m", gpu_needs(1, 8), free(50, 3), [held("busy", 2, 6, idle=False)])
    assert room.wait and room.victims == ()


def test_a_load_under_way_counts_what_it_will_still_take():
    loading = held("loading", 1, 1, idle=False, pending=(0, 5))
    assert make_room("m", gpu_needs(1, 4), free(50, 8), [loading]).wait
    assert make_room("m", gpu_needs(1, 3), free(50, 8), [loading]).victims == ()


def test_a_model_too_large_even_alone_is_refused_with_the_numbers():
    with pytest.raises(TooLarge) as e:
        make_room("big", gpu_needs(1, 30), free(50, 10), [held("a", 1, 8)])
    msg = str(e.value)
    assert msg.startswith("model 'big' does not fit: it needs 30.0 GiB of GPU memory (")
    assert "and 18.0 GiB is free with no other model loaded" in msg
    with pytest.raises(TooLarge, match=r"100.0 GiB of host memory for its expert banks, and 60.0"):
        make_room("big", gpu_needs(100, 1), free(50, 10), [held("a", 10, 1)])


def test_unknown_gpu_memory_judges_host_memory_only():
    assert make_room("m", gpu_needs(1, 500), free(50, None), []) == Room(need=Footprint(GiB, 0))
    cpu = Needs(20 * GiB, 0, GiB, GiB, 0, on_gpu=False)
    with pytest.raises(TooLarge, match="host memory for its weights and KV cache"):
        make_room("m", cpu, Free(10 * GiB, gpu=False), [])
