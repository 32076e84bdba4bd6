"""How much of a miss split by its rows the GPU reads (moe/paths.py)."""

from __future__ import annotations

from freetoken.kernels.moe_gpu import ROW_BLOCK
from freetoken.moe.dispatch import Split
from freetoken.moe.paths import first_cpu_row


def test_a_set_share_is_rounded_to_the_kernels_row_blocks():
    split = Split.from_bandwidths(1 << 20, 50e9, 100e9)
    assert first_cpu_row(0.25, split, 768) == 192
    assert first_cpu_row(0.3, split, 768) == 224  # 230.4 rows: 14.4 blocks, 14 of them
    assert first_cpu_row(0.0, split, 768) == 0  # off
    assert first_cpu_row(0.5, split, 32) == ROW_BLOCK


def test_auto_balances_the_two_paths_times_an_expert():
    # the CPU twice as fast as PCIe: the GPU reads a third of the rows
    split = Split.from_bandwidths(1 << 20, 50e9, 100e9)
    assert first_cpu_row(None, split, 768) == 256
    # a measured fetch kernel's time an expert stands for PCIe's
    fetched = Split.from_bandwidths(1 << 20, 50e9, 100e9, b_fetch=100e9)
    assert first_cpu_row(None, fetched, 768) == 384


def test_a_split_that_leaves_a_path_nothing_is_no_split():
    split = Split.from_bandwidths(1 << 20, 50e9, 100e9)
    assert first_cpu_row(0.01, split, 768) == 0  # under half a block: all on the CPU
    assert first_cpu_row(0.99, split, 768) == 0  # all but nothing on the GPU: not split
    assert first_cpu_row(0.9, split, 16) == 0  # one block an expert: nothing to split
