"""Exact bytes, alignment and round trips of the FTW writer and reader."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import pytest
import torch

from freetoken.ftw import ALIGN, FtwError, reader
from freetoken.ftw.writer import Writer


def _write(tmp: Path, tensors, shard_limit=4 * ALIGN) -> Path:
    (tmp / "config.json").write_text("{}")
    w = Writer(tmp / "m", shard_limit)
    for kind, name, t in tensors:
        if kind == "dense":
            w.add_dense(name, t)
        else:
            w.add_bank(name[0], name[1], t)
    return w.close({"model_type": "test"}, {"config.json": tmp / "config.json"})


def _files(d: Path) -> dict[str, Path]:
    return {p.name: p for p in d.iterdir()}


def test_exact_bytes_of_a_small_file(tmp_path):
    a = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float32)
    b = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)
    out = _write(tmp_path, [("dense", "a", a), ("bank", (0, "down"), b)])
    data = (out / "ftw-00000.bin").read_bytes()
    expected = (
        struct.pack("<3f", 1.0, -2.0, 0.5)
        + bytes(ALIGN - 12)
        + struct.pack("<4i", 1, 2, 3, 4)
        + bytes(ALIGN - 16)
    )
    assert data == expected
    index = json.loads((out / "ftw.json").read_text())
    assert index["format"] == "freetoken-ftw" and index["version"] == 1 and index["align"] == ALIGN
    assert index["total_bytes"] == 2 * ALIGN
    assert index["shards"] == [{"file": "ftw-00000.bin", "offset": 0, "nbytes": 2 * ALIGN}]
    assert index["tensors"][0] == {
        "name": "a",
        "kind": "dense",
        "dtype": "float32",
        "shape": [3],
        "offset": 0,
        "nbytes": 12,
        "crc32": zlib.crc32(struct.pack("<3f", 1.0, -2.0, 0.5)),
    }
    assert index["tensors"][1]["name"] == "down#L00000" and index["tensors"][1]["offset"] == ALIGN
    assert index["metadata_files"] == ["config.json"] and (out / "config.json").exists()


def test_round_trip_alignment_and_shards(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = [
        ("dense", "small", torch.randn(7, 3, generator=g)),
        ("bank", (0, "gate_up"), torch.randn(4, 6, 100, generator=g).to(torch.bfloat16)),
        ("dense", "half", torch.randn(33, generator=g).to(torch.float16)),
        ("bank", (1, "down"), torch.randn(3, ALIGN + 5, generator=g)),  # larger than a shard
        ("dense", "empty", torch.zeros(0)),
    ]
    out = _write(tmp_path, tensors)
    index = json.loads((out / "ftw.json").read_text())
    for t in index["tensors"]:
        assert t["offset"] % ALIGN == 0
    for s in index["shards"]:
        assert s["offset"] % ALIGN == 0 and s["nbytes"] % ALIGN == 0 and s["nbytes"] <= 4 * ALIGN
        assert (out / s["file"]).stat().st_size == s["nbytes"]
    assert len(index["shards"]) > 1
    # a tensor that fits in a shard never straddles one
    for t in index["tensors"]:
        if t["nbytes"] <= 4 * ALIGN:
            starts = [s["offset"] for s in index["shards"]]
            assert not any(t["offset"] < b < t["offset"] + t["nbytes"] for b in starts)
    for mode in ("parallel", "serial"):
        w = reader.read(_files(out), mode=mode, verify=True, workers=3)
        assert torch.equal(w.dense["small"], tensors[0][2])
        assert torch.equal(w.banks[(0, "gate_up")], tensors[1][2])
        assert torch.equal(w.dense["half"], tensors[2][2])
        assert torch.equal(w.banks[(1, "down")], tensors[3][2])
        assert w.dense["empty"].numel() == 0


def test_bad_files_fail_with_file_and_offset(tmp_path):
    out = _write(tmp_path, [("dense", "a", torch.randn(2000)), ("dense", "b", torch.randn(10))])
    files = _files(out)
    shard = out / "ftw-00000.bin"
    good = shard.read_bytes()
    shard.write_bytes(good[:ALIGN])  # truncated
    with pytest.raises(FtwError, match=r"ftw-00000.bin: truncated.*offset 4096"):
        reader.read(files)
    corrupt = bytearray(good)
    corrupt[100] ^= 0xFF
    shard.write_bytes(bytes(corrupt))
    with pytest.raises(FtwError, match=r"tensor a at offset 0 fails its CRC"):
        reader.read(files, verify=True)
    shard.write_bytes(good)
    index = json.loads((out / "ftw.json").read_text())
    index["version"] = 99
    (out / "ftw.json").write_text(json.dumps(index))
    with pytest.raises(FtwError, match="version 99 is not supported"):
        reader.read(files)
    index["version"] = 1
    index["tensors"][1]["offset"] += 8
    (out / "ftw.json").write_text(json.dumps(index))
    with pytest.raises(FtwError, match="misaligned offset"):
        reader.read(files)
    (out / "ftw.json").write_text("{not json")
    with pytest.raises(FtwError, match="ftw.json: cannot read"):
        reader.read(files)


def test_a_failed_write_leaves_nothing_behind(tmp_path):
    w = Writer(tmp_path / "m", 4 * ALIGN)
    w.add_dense("a", torch.randn(10))
    w.abort()
    assert not any(tmp_path.iterdir())


def test_read_mode_follows_available_memory():
    assert reader.choose_mode(1 << 30, 64 << 30, 8).mode == "parallel"
    assert reader.choose_mode(1 << 30, (1 << 30) + (1 << 20), 8).mode == "serial"
    assert reader.choose_mode(1 << 30, None, 8).mode == "parallel"


def test_o_direct_refusal_falls_back_to_buffered_reads(tmp_path, monkeypatch, caplog):
    import errno
    import os

    out = _write(tmp_path, [("dense", "a", torch.randn(100))])
    real_open = os.open

    def refusing_open(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", refusing_open)
    stats = reader.LoadStats()
    w = reader.read(_files(out), stats=stats)
    assert not stats.direct and "refuses O_DIRECT" in caplog.text
    assert w.dense["a"].shape == (100,)


def test_digests_name_every_file_as_written(tmp_path):
    import hashlib

    tensors = [("dense", f"t{i}", torch.randn(700 + i)) for i in range(6)]
    w = Writer(tmp_path / "m", 2 * ALIGN)
    for _, name, t in tensors:
        w.add_dense(name, t)
    (tmp_path / "config.json").write_text("{}")
    out = w.close({"model_type": "test"}, {"config.json": tmp_path / "config.json"})
    files = sorted(p.name for p in out.iterdir())
    assert len([f for f in files if f.startswith("ftw-")]) > 1 and sorted(w.digests) == files
    for name, digest in w.digests.items():
        assert digest == "sha256:" + hashlib.sha256((out / name).read_bytes()).hexdigest()
