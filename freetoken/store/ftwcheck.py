"""What create checks of an FTW model before it is listed (docs/ftw.md is the format).

The runner reads FTW with direct I/O at the offsets the index gives; an index with absurd
sizes, or a shard shorter than the index says, used to be stored as a model that every
first use failed with a 500. The store imports no torch, so this reads only the index and
the files' sizes: the index's shape, the shards laid end to end as the format requires,
every tensor inside them, and every shard present at exactly its length.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["FTWInvalid", "check_ftw"]

FORMAT, VERSION = "freetoken-ftw", 1


class FTWInvalid(ValueError):
    """The FTW files cannot be a model; the message says what is wrong."""


def _int(obj: dict[str, Any], key: str, where: str) -> int:
    value = obj.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise FTWInvalid(f"{where}: {key} must be a whole number of bytes, not {value!r}")
    return value


def _shards(index: dict[str, Any], align: int) -> list[tuple[str, int]]:
    shards = index.get("shards")
    if not isinstance(shards, list) or not shards:
        raise FTWInvalid("the index lists no shards")
    out, pos = [], 0
    for i, shard in enumerate(shards):
        where = f"shard {i}"
        if not isinstance(shard, dict) or not isinstance(shard.get("file"), str):
            raise FTWInvalid(f"{where}: expected an object with a file name")
        offset, nbytes = _int(shard, "offset", where), _int(shard, "nbytes", where)
        if offset != pos or nbytes % align:
            raise FTWInvalid(
                f"{where} ({shard['file']}): at {offset} (+{nbytes}), where the shards before "
                f"it end at {pos} and every shard is a multiple of {align} bytes"
            )
        out.append((shard["file"], nbytes))
        pos += nbytes
    if _int(index, "total_bytes", "the index") != pos:
        raise FTWInvalid(f"the shards hold {pos} bytes, total_bytes says {index['total_bytes']}")
    return out


def _tensors(index: dict[str, Any], total: int) -> None:
    tensors = index.get("tensors")
    if not isinstance(tensors, list) or not tensors:
        raise FTWInvalid("the index lists no tensors")
    for i, t in enumerate(tensors):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise FTWInvalid(f"tensor {i}: expected an object with a name")
        where = f"tensor {t['name']}"
        offset, nbytes = _int(t, "offset", where), _int(t, "nbytes", where)
        shape = t.get("shape")
        if not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
            raise FTWInvalid(f"{where}: shape must be a list of sizes, not {shape!r}")
        if offset + nbytes > total:
            raise FTWInvalid(f"{where}: ends at {offset + nbytes}, past the {total} bytes stored")


def check_ftw(index: Any, size_of: Callable[[str], int | None]) -> None:
    """Raises FTWInvalid unless `index` (ftw.json) describes shards that `size_of` (a file
    name -> its size, None when absent) finds whole."""
    if not isinstance(index, dict):
        raise FTWInvalid("the index is not a JSON object")
    if index.get("format") != FORMAT or index.get("version") != VERSION:
        raise FTWInvalid(f"not {FORMAT} version {VERSION}")
    align = _int(index, "align", "the index")
    if align == 0:
        raise FTWInvalid("the index: align must be positive")
    shards = _shards(index, align)
    _tensors(index, sum(n for _, n in shards))
    for name, nbytes in shards:
        size = size_of(name)
        if size is None:
            raise FTWInvalid(f"shard {name} is missing")
        if size != nbytes:
            raise FTWInvalid(f"shard {name} has {size} bytes, the index says {nbytes}")
