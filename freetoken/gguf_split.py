"""GGUF files split in parts, as llama.cpp's gguf-split writes large models:
`NAME-00001-of-00003.gguf` … `NAME-00003-of-00003.gguf`, the first part holding the
metadata and every part some of the tensors (each says `split.no`, `split.count` and
`split.tensors.count`). Naming any part names the whole model.

Torch-free: the CLI, the store and the readers all use it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

__all__ = ["MissingParts", "first_of", "part_names", "parts"]

_PART = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


class MissingParts(ValueError):
    """Parts of a split GGUF are not where the named part is."""


def part_names(name: str) -> list[str] | None:
    """Every part's file name, in order, from one part's; None for a file not so named."""
    m = _PART.match(name)
    if m is None or not 1 <= int(m["no"]) <= int(m["count"]):
        return None
    count = int(m["count"])
    return [f"{m['stem']}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]


def parts(path: Path) -> list[Path]:
    """The files of the model `path` is (a part of): [path] for a whole GGUF file. Raises
    MissingParts naming the parts that are not beside it."""
    names = part_names(path.name)
    if names is None:
        return [path]
    found = [path.with_name(n) for n in names]
    missing = [p.name for p in found if not p.is_file()]
    if missing:
        raise MissingParts(
            f"{path.name} is one of {len(names)} parts of a split GGUF; "
            f"missing beside it: {', '.join(missing)}"
        )
    return found


def first_of(names: Iterable[str]) -> str | None:
    """The first part's name where `names` are exactly the parts of one split GGUF."""
    given = sorted(names)
    if not given:
        return None
    expected = part_names(given[0])
    return given[0] if expected is not None and sorted(expected) == given else None
