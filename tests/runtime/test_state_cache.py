"""The recurrent state slots: sized from the KV layout, a slot zeroed when it is taken, and
the scheduler's use of them (one per running sequence, given back on finish and on
preemption; no prefix reuse for a model that keeps state)."""

from __future__ import annotations

import pytest
import torch

from freetoken.models.base import KVLayout
from freetoken.runtime.kv_cache import KVCache
from freetoken.runtime.sampling import SamplingParams
from freetoken.runtime.scheduler import Scheduler
from freetoken.runtime.sequence import Sequence, Status
from freetoken.runtime.state_cache import OutOfSlots, StateCache

LAYOUT = [
    KVLayout("recurrent", state=((24, 3), (2, 4, 8))),
    KVLayout.attention(2, 8),
    KVLayout("recurrent", state=((24, 3), (2, 4, 8))),
]


def test_pool_is_sized_from_the_layout():
    pool = StateCache.for_layout(LAYOUT, 3, torch.bfloat16, torch.device("cpu"))
    assert pool.conv[1] is None and pool.recurrent[1] is None
    assert pool.conv[0].shape == (3, 24, 3) and pool.conv[0].dtype == torch.bfloat16
    assert pool.recurrent[2].shape == (3, 2, 4, 8) and pool.recurrent[2].dtype == torch.float32
    assert pool.bytes == 3 * StateCache.slot_bytes(LAYOUT, torch.bfloat16)
    assert StateCache.slot_bytes(LAYOUT, torch.bfloat16) == 2 * (24 * 3 * 2 + 2 * 4 * 8 * 4)
    attention_only = [KVLayout.attention(2, 8)] * 2
    assert StateCache.for_layout(attention_only, 3, torch.float32, torch.device("cpu")) is None


def test_a_slot_taken_is_zeroed_and_each_is_held_once():
    pool = StateCache(LAYOUT, 2, torch.float32, torch.device("cpu"))
    a = pool.alloc()
    pool.recurrent[0][a] = 1.0
    pool.conv[2][a] = 2.0
    b = pool.alloc()
    assert {a, b} == {0, 1} and pool.num_free == 0
    with pytest.raises(OutOfSlots):
        pool.alloc()
    pool.free(a)
    with pytest.raises(ValueError):
        pool.free(a)
    assert pool.alloc() == a
    assert not pool.recurrent[0][a].any() and not pool.conv[2][a].any()


def test_saved_states_come_back():
    """What a graph capture's warm-up step changes in the batch's slots is put back."""
    pool = StateCache(LAYOUT, 3, torch.float32, torch.device("cpu"))
    pool.recurrent[2][1] = 3.0
    slots = torch.tensor([2, 1])
    kept = pool.save(slots)
    pool.recurrent[2][1] += 1.0
    pool.conv[0][2] = 5.0
    pool.restore(slots, kept)
    assert (pool.recurrent[2][1] == 3.0).all() and not pool.conv[0][2].any()


def _seq(n: int) -> Sequence:
    return Sequence(list(range(1, n + 1)), SamplingParams(), 8, frozenset())


def test_scheduler_gives_each_running_sequence_a_slot_and_takes_it_back():
    kv = KVCache(LAYOUT, 6, 4, torch.float32, torch.device("cpu"))
    pool = StateCache(LAYOUT, 2, torch.float32, torch.device("cpu"))
    sched = Scheduler(kv, max_running=2, chunk=64, state=pool)
    seqs = [_seq(9), _seq(6), _seq(3)]
    for s in seqs:
        sched.add(s)
    plan = sched.schedule()
    assert [s for s, _ in plan] == seqs[:2]  # the third waits for a slot
    assert {seqs[0].state_slot, seqs[1].state_slot} == {0, 1} and seqs[2].state_slot is None
    for s, n in plan:
        s.num_cached += n
    # the first needs more pages than are free: the second is preempted, its slot given back
    seqs[0].output_ids.extend(range(12))
    plan = sched.schedule()
    assert [s for s, _ in plan] == [seqs[0]]
    assert seqs[1].status is Status.WAITING and seqs[1].state_slot is None
    assert seqs[1].num_cached == 0 and pool.num_free == 1
    sched.remove(seqs[0])
    assert pool.num_free == 2 and seqs[0].state_slot is None
