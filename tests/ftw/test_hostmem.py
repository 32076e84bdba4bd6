"""Host memory when the platform refuses to pin it: the load goes on with pageable banks,
and copies to the device go through the pinned staging ring, byte for byte."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from freetoken.ftw import hostmem
from freetoken.models.base import ExpertSpec
from freetoken.moe.banks import HostBanks
from freetoken.moe.cache import ExpertCache
from freetoken.moe.placement import PlacementState


@pytest.fixture
def refusing(monkeypatch):
    """cudaHostRegister as a memlock limit or a pin quota answers it: an error code."""
    monkeypatch.setattr(hostmem, "_refused", None)
    monkeypatch.setattr(hostmem, "_register", lambda address, nbytes: 2)


def test_a_refused_pin_leaves_the_buffers_pageable_and_says_why(refusing):
    bufs = [hostmem.HostBuffer(1 << 20) for _ in range(3)]
    pinner = hostmem.Pinner()
    for b in bufs:
        pinner.submit(b)
    pinner.finish()  # no exception: the load goes on
    assert not any(b.pinned for b in bufs)
    why = str(hostmem.refused())
    assert why.startswith("cudaHostRegister of 1 MiB failed with error 2")
    assert "memlock" in why


def test_memlock_limit_reads_the_soft_limit():
    limit = hostmem.memlock_limit()
    assert limit is None or limit >= 0


@pytest.mark.parametrize("nbytes", [1, 999, 4096, 10_007])
def test_the_ring_copies_exactly_in_slot_sized_pieces(nbytes):
    ring = hostmem.StagingRing(torch.device("cpu"), slot_bytes=1000, slots=2)
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    ring.copy(dst, src)
    assert torch.equal(dst, src) and ring.bytes == nbytes


def test_the_ring_copies_typed_rows():
    ring = hostmem.StagingRing(torch.device("cpu"), slot_bytes=64, slots=3)
    src = torch.randn(7, 5, dtype=torch.float32).to(torch.bfloat16)
    dst = torch.zeros(7, 5, dtype=torch.bfloat16)
    ring.copy(dst, src)
    assert torch.equal(dst, src)
    assert ring.measure(torch.device("cpu"), nbytes=1 << 16) > 0


def test_pageable_banks_fill_the_cache_through_the_ring(refusing):
    L, E, H, I = 2, 6, 8, 4
    g = torch.Generator().manual_seed(0)
    raw = {}
    for layer in range(L):
        raw[(layer, "gate_up")] = torch.randn((E, 2 * I, H), generator=g)
        raw[(layer, "down")] = torch.randn((E, H, I), generator=g)
    hb = HostBanks(raw, torch.float32, pin=True, spec=ExpertSpec(H, I))
    assert not hb.pinned and hb.ring is not None
    cache = ExpertCache(L, E, 5, hb.rows, hb.dtypes, torch.device("cpu"))
    state = PlacementState(hb, cache, torch.device("cpu"))
    experts = np.array([4, 1, 3])
    slots = cache.allocate(1, experts, np.empty(0, dtype=np.int64))
    state.copy_in(1, experts, slots)
    for bank in ("gate_up", "down"):
        for e, s in zip(experts.tolist(), slots.tolist()):
            assert torch.equal(cache.slots[bank][s], raw[(1, bank)][e])
    assert hb.ring.bytes == 3 * hb.expert_bytes


def test_packed_experts_narrower_than_their_slots_go_through_the_ring(refusing):
    """A layer in Q4_K beside one in Q6_K: slots are as wide as Q6_K's, so a run of Q4_K
    experts fills a strided part of them, which the ring copies a row at a time."""
    from freetoken.moe.cache import expert_part
    from tests.kernels.experts import packed_banks

    L, E, H, I = 2, 4, 256, 256
    g = torch.Generator().manual_seed(1)
    raw, formats = {}, {}
    for layer, fmt in enumerate(("q6_k", "q4_k")):
        spec = ExpertSpec(H, I, formats=(fmt, fmt))
        for b, t in packed_banks(E, spec, g).items():
            raw[(layer, b)], formats[(layer, b)] = t, fmt
    hb = HostBanks(raw, torch.float32, pin=True, spec=ExpertSpec(H, I), formats=formats)
    assert hb.ring is not None
    cache = ExpertCache(L, E, 4, hb.rows, hb.dtypes, torch.device("cpu"))
    for bank in ("gate_up", "down"):
        src = hb.banks[1][bank][1:4]
        dst = expert_part(cache.slots[bank], slice(0, 3), src)
        assert not dst.is_contiguous()
        hb.h2d(dst, src, False)
        assert torch.equal(dst, src)


class FakeDriver:
    """CUDA's host registrations as the driver keeps them: by address, refused twice, and
    not to be touched while a graph is captured."""

    def __init__(self):
        self.registered: dict[int, int] = {}
        self.capturing = False

    def register(self, address: int, nbytes: int) -> int:
        if address in self.registered:
            return hostmem.ALREADY_REGISTERED
        self.registered[address] = nbytes
        return 0

    def unregister(self, address: int) -> int:
        if self.capturing:
            return 900  # not permitted while a stream is captured
        return 0 if self.registered.pop(address, None) is not None else 713


@pytest.fixture
def driver(monkeypatch):
    d = FakeDriver()
    monkeypatch.setattr(hostmem, "_register", d.register)
    monkeypatch.setattr(hostmem, "_unregister", d.unregister)
    monkeypatch.setattr(hostmem, "_freed", [])
    return d


def test_a_pinned_buffer_freed_during_a_capture_unregisters_after_it(driver):
    buf = hostmem.HostBuffer(1 << 16)
    buf.pin()
    address = buf.address
    with hostmem.capturing():
        driver.capturing = True
        del buf  # the garbage collector may do this anywhere
        assert address in driver.registered  # kept registered and mapped meanwhile
        driver.capturing = False
    assert address not in driver.registered


def test_a_freed_pinned_buffer_unregisters_at_once_outside_captures(driver):
    buf = hostmem.HostBuffer(1 << 16)
    buf.pin()
    address = buf.address
    del buf
    assert address not in driver.registered


def test_a_stale_registration_at_a_new_mappings_address_is_replaced(driver):
    buf = hostmem.HostBuffer(1 << 16)
    driver.registered[buf.address] = 1 << 16  # left by a mapping freed without unregistering
    buf.pin()
    assert buf.pinned and driver.registered[buf.address] == len(buf.mm)


@pytest.mark.gpu
def test_freeing_a_pinned_buffer_inside_a_real_capture_keeps_the_capture():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    buf = hostmem.HostBuffer(1 << 20)
    buf.pin()
    x = torch.ones(8, device="cuda")
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), hostmem.capturing():
        graph.capture_begin()
        y = x * 2
        del buf  # would be cudaHostUnregister inside the capture
        graph.capture_end()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, torch.full((8,), 2.0, device="cuda"))
    again = hostmem.HostBuffer(1 << 20)
    again.pin()  # no registration was left behind the freed mapping
    assert again.pinned
