"""Reading part of an FTW model: one rank's rows of every bank, without the dense tensors."""

from __future__ import annotations

import pytest
import torch

from freetoken.ftw import reader
from freetoken.ftw.convert import convert
from tests import fixtures
from tests.runtime.engine_util import files_of


@pytest.fixture(scope="module")
def odd_ftw(tmp_path_factory):
    # expert rows of 7680 and 3840 bytes: no row range starts or ends on a 4096-byte boundary
    src = tmp_path_factory.mktemp("odd")
    fixtures.hf_qwen3_moe(
        src,
        seed=5,
        hidden_size=48,
        moe_intermediate_size=20,
        intermediate_size=40,
        head_dim=16,
        num_experts=7,
    )
    return files_of(convert(src, tmp_path_factory.mktemp("odd-ftw") / "ftw", shard_limit=16 * 4096))


@pytest.mark.parametrize("experts", [(0, 3), (3, 5), (5, 7), (0, 7)])
def test_rows_of_every_bank_and_nothing_else(odd_ftw, experts):
    whole = reader.read(odd_ftw, verify=True)
    part = reader.read(odd_ftw, experts=experts, dense=False, verify=True)
    lo, hi = experts
    assert part.dense == {} and set(part.banks) == set(whole.banks)
    for key, bank in whole.banks.items():
        assert torch.equal(part.banks[key], bank[lo:hi])
    with_dense = reader.read(odd_ftw, experts=experts)
    assert set(with_dense.dense) == set(whole.dense)


def test_huge_page_mappings_hold_what_was_read(odd_ftw):
    plain = reader.read(odd_ftw, verify=True, huge_pages=False)
    huge = reader.read(odd_ftw, mode="parallel", workers=3, huge_pages=True, verify=True)
    for key, bank in plain.banks.items():
        assert torch.equal(huge.banks[key], bank)
    for name, t in plain.dense.items():
        assert torch.equal(huge.dense[name], t)


def test_huge_pages_by_default_only_where_they_fill_faster(odd_ftw, monkeypatch):
    from freetoken.ftw import hostmem

    chosen = []
    real = hostmem.HostBuffer
    monkeypatch.setattr(
        reader, "HostBuffer", lambda n, huge=False: chosen.append(huge) or real(n, huge)
    )
    for pays in (True, False):
        monkeypatch.setattr(hostmem, "huge_pages_pay", lambda pays=pays: pays)
        chosen.clear()
        reader.read(odd_ftw)
        assert chosen and set(chosen) == {pays}
    monkeypatch.undo()
    pays = hostmem.huge_pages_pay()  # measured here, once, then remembered
    assert isinstance(pays, bool) and hostmem.huge_pages_pay() is pays
    small, huge = hostmem._fault_seconds(False), hostmem._fault_seconds(True)
    assert small > 0 and huge > 0


def test_weights_beyond_the_memory_available_are_refused_before_any_read(odd_ftw, monkeypatch):
    """Refused with the numbers (needed, available) before a byte is allocated or read; a
    share that fits is read, and where the host cannot say, nothing is refused."""
    need = sum(int(t["nbytes"]) for t in reader.Index.load(odd_ftw).tensors)
    monkeypatch.setattr(reader, "mem_available", lambda: need // 2)
    monkeypatch.setattr(reader, "HostBuffer", lambda *a: pytest.fail("allocated"))
    with pytest.raises(reader.HostMemoryError, match=r"need 0\.\d GiB .* 0\.\d GiB is available"):
        reader.read(odd_ftw)
    monkeypatch.undo()
    monkeypatch.setattr(reader, "mem_available", lambda: need // 2)
    assert reader.read(odd_ftw, experts=(0, 1), dense=False).banks
    monkeypatch.setattr(reader, "mem_available", lambda: None)
    assert reader.read(odd_ftw).banks
