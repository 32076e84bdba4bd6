"""Expert banks read straight from safetensors files into place, when nothing about their
pieces needs changing on the way.

Gathering a bank through mapped tensors copies every piece out of the mapping one page fault
at a time: on the H200's host that ran at 1.7 GB/s and was a third of a 16 GB create. Most
checkpoints store one tensor per expert (and gate/up half), in the dtype the bank keeps and
in its orientation; each such piece is one contiguous run of the bank's bytes, so it is read
with `readinto` at its file offset (the kernel copies from the page cache, no faults), on a
few threads at once. Anything else — a converted dtype, transposed or interleaved pieces,
packed blocks, whole-bank tensors, a gap or a repeat — returns None and takes the general
path (weights/experts.py), which also words the errors.
"""

from __future__ import annotations

import json
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from freetoken.models.base import ExpertKey

READERS = 8
_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
_pool: ThreadPoolExecutor | None = None  # the readers, started once: a 16 GB model has 322 banks
_pool_lock = threading.Lock()


def _readers() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=READERS, thread_name_prefix="bank-read")
        return _pool


@dataclass(frozen=True)
class Stored:
    """Where one tensor's bytes lie in its file."""

    path: Path
    dtype: str  # safetensors' name
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def header(path: Path) -> dict[str, Stored]:
    """Every tensor of a safetensors file, from its header alone."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        entries = json.loads(f.read(n))
    out = {}
    for name, e in entries.items():
        if name == "__metadata__":
            continue
        start, end = e["data_offsets"]
        out[name] = Stored(path, e["dtype"], tuple(e["shape"]), 8 + n + start, end - start)
    return out


def read_bank(
    pieces: list[tuple[Stored, ExpertKey]], num_experts: int, dtype: torch.dtype | None
) -> torch.Tensor | None:
    """The [E, rows, ...] bank of per-expert pieces, read in place; None where they are not
    plain (see the module's text)."""
    plan = _plan(pieces, num_experts, dtype)
    if plan is None:
        return None
    bank, runs = plan
    flat = memoryview(bank.view(torch.uint8).reshape(-1).numpy()).cast("B")
    jobs = [runs[i::READERS] for i in range(READERS)]
    pool = _readers()
    futures = [pool.submit(_read_runs, job, flat) for job in jobs if job]
    try:
        for f in futures:
            f.result()  # a short or failed read is raised here
    finally:  # no reader may still be writing into the bank once it is dropped
        for f in futures:
            if not f.cancel():
                f.exception()  # waits for a read already running
    return bank


def _plan(
    pieces: list[tuple[Stored, ExpertKey]], num_experts: int, dtype: torch.dtype | None
) -> tuple[torch.Tensor, list[tuple[Stored, int]]] | None:
    """The empty bank and each piece's byte offset in it, or None."""
    if not pieces:
        return None
    first, k0 = pieces[0]
    kept = _DTYPES.get(first.dtype)
    plain = all(
        s.dtype == first.dtype
        and s.shape == first.shape
        and k.expert is not None
        and (k.half is None) == (k0.half is None)
        and not (k.transposed or k.interleaved)
        for s, k in pieces
    )
    if kept is None or (dtype is not None and dtype != kept) or not plain or not first.shape:
        return None
    rows = first.shape[0] * (2 if k0.half is not None else 1)
    bank = torch.empty((num_experts, rows, *first.shape[1:]), dtype=kept)
    row_bytes = bank[0, 0].numel() * bank.element_size()
    if first.nbytes != first.shape[0] * row_bytes:
        return None
    runs, filled = [], set()
    for s, k in pieces:
        half = k.half or 0
        if not 0 <= k.expert < num_experts or (k.expert, half) in filled:
            return None
        filled.add((k.expert, half))
        runs.append((s, (k.expert * rows + half * s.shape[0]) * row_bytes))
    halves = 2 if k0.half is not None else 1
    return (bank, runs) if len(filled) == num_experts * halves else None


def _read_runs(runs: list[tuple[Stored, int]], flat: memoryview) -> None:
    files = {}
    try:
        for s, at in runs:
            f = files.get(s.path)
            if f is None:
                f = files[s.path] = open(s.path, "rb", buffering=0)
            f.seek(s.offset)
            view, done = flat[at : at + s.nbytes], 0
            while done < s.nbytes:
                n = f.readinto(view[done:])
                if not n:
                    raise OSError(f"{s.path}: ends inside a tensor's bytes")
                done += n
    finally:
        for f in files.values():
            f.close()
