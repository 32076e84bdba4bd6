"""Writes FTW: tensors appended to one logical, 4096-aligned byte region cut into shards.

    w = Writer(out_dir); w.add_dense(name, t); w.add_bank(layer, "gate_up", t); w.close(meta)

Packed tensors (freetoken/quant) are written as their raw blocks, with the logical shape and
the format in the index (docs/ftw.md).

The directory is built under a temporary name and renamed when complete, so nothing
half-written is ever visible under the final name.

Shards are written, hashed (SHA-256) and checksummed on threads of their own while the
caller reads and assembles the next tensors (ftw/sink.py), and `Writer.digests` names every
file written: whoever stores the files under their digests (the model store) need not read
them back.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from freetoken import quant
from freetoken.ftw import (
    ALIGN,
    DEFAULT_SHARD_LIMIT,
    FORMAT,
    INDEX,
    VERSION,
    FtwError,
    bank_name,
    round_up,
)
from freetoken.ftw.sink import Checksums, Sink

_ZEROS = bytes(ALIGN)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a tensor (any dtype, bf16 included)."""
    flat = t.detach().contiguous().reshape(-1).cpu()
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


class Writer:
    def __init__(self, out: Path, shard_limit: int = DEFAULT_SHARD_LIMIT):
        if shard_limit <= 0 or shard_limit % ALIGN:
            raise FtwError(f"shard_limit must be a positive multiple of {ALIGN}")
        self.out = Path(out)
        self.tmp = self.out.with_name(self.out.name + ".partial")
        if self.tmp.exists():
            shutil.rmtree(self.tmp)
        self.tmp.mkdir(parents=True)
        self.shard_limit = shard_limit
        self.tensors: list[dict[str, Any]] = []
        self.shards: list[dict[str, Any]] = []
        self.pos = 0  # end of the logical region written so far (always aligned)
        self._sink = Sink()
        self._crcs = Checksums()
        self._open = False  # a shard is being written
        self._shard_start = 0
        self.bytes_written = 0
        self.digests: dict[str, str] = {}  # file name -> sha256 digest, once closed

    def _open_shard(self) -> None:
        self._close_shard()
        name = f"ftw-{len(self.shards):05d}.bin"
        self._sink.open(self.tmp / name)
        self._open = True
        self._shard_start = self.pos
        self.shards.append({"file": name, "offset": self.pos, "nbytes": 0})

    def _close_shard(self) -> None:
        if self._open:
            self.shards[-1]["nbytes"] = self.pos - self._shard_start
            self._open = False

    def _write(self, data: memoryview) -> None:
        """Appends data, moving to a new shard whenever the current one is full."""
        while len(data):
            if not self._open or self.pos - self._shard_start >= self.shard_limit:
                self._open_shard()
            room = self.shard_limit - (self.pos - self._shard_start)
            n = min(room, len(data))
            self._sink.write(data[:n])
            self.pos += n
            self.bytes_written += n
            data = data[n:]

    def _add(self, entry: dict[str, Any], t: torch.Tensor, fmt: str | None) -> None:
        shape = list(t.shape)
        if fmt:  # packed blocks: the logical shape, and the format that says how to read them
            shape[-1] = quant.get(fmt).logical_cols(shape[-1])
            entry["quant"] = fmt
        data = tensor_bytes(t)
        padded = round_up(len(data))
        used = self.pos - self._shard_start
        if not self._open or (padded <= self.shard_limit and used + padded > self.shard_limit):
            self._open_shard()
        entry.update(
            dtype=dtype_name(t.dtype),
            shape=shape,
            offset=self.pos,
            nbytes=len(data),
        )
        self._crcs.add(entry, data)
        self._write(data)
        if padded > len(data):
            self._write(memoryview(_ZEROS[: padded - len(data)]))
        self.tensors.append(entry)

    def add_dense(self, name: str, t: torch.Tensor, fmt: str | None = None) -> None:
        """A dense tensor; `fmt` names the block format of a packed one (uint8)."""
        self._add({"name": name, "kind": "dense"}, t, fmt)

    def add_bank(self, layer: int, bank: str, t: torch.Tensor, fmt: str | None = None) -> None:
        entry = {"name": bank_name(layer, bank), "kind": "bank", "layer": layer, "bank": bank}
        self._add(entry, t, fmt)

    def close(self, meta: dict[str, Any], metadata_files: dict[str, Path] | None = None) -> Path:
        """Writes the index and metadata files and moves the directory into place; `digests`
        then names every file."""
        self._close_shard()
        self._sink.finish()
        self._crcs.resolve()
        for name, src in (metadata_files or {}).items():
            shutil.copyfile(src, self.tmp / name)
        index = {
            "format": FORMAT,
            "version": VERSION,
            "align": ALIGN,
            "shard_limit": self.shard_limit,
            "total_bytes": self.pos,
            "shards": self.shards,
            "tensors": self.tensors,
            **meta,
            "metadata_files": sorted(metadata_files or {}),
        }
        (self.tmp / INDEX).write_text(json.dumps(index, indent=1))
        for f in self.tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        # the small files are hashed here; the shards were as they were written
        self.digests = {
            f.name: self._sink.digests.get(f.name) or _digest(f) for f in self.tmp.iterdir()
        }
        if self.out.exists():
            shutil.rmtree(self.out)
        os.rename(self.tmp, self.out)
        return self.out

    def abort(self) -> None:
        self._open = False
        self._sink.stop()  # what the threads met no longer matters: their files go
        self._crcs.abort()
        shutil.rmtree(self.tmp, ignore_errors=True)
