"""Reads FTW with aligned direct I/O straight into the final host memory.

Every tensor's bytes land in a page-aligned anonymous mapping by `preadv` on an O_DIRECT
descriptor: no page cache, no bounce copy. Expert banks are pinned (cudaHostRegister)
after they are filled, on a background thread, so pinning overlaps reading and never
touches empty pages. Filesystems that refuse O_DIRECT get buffered reads instead.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from freetoken import quant
from freetoken.ftw import ALIGN, FORMAT, INDEX, VERSION, FtwError, hostmem, round_up
from freetoken.ftw.hostmem import HostBuffer, Pinner
from freetoken.weights import ModelWeights

log = logging.getLogger(__name__)

CHUNK = 8 << 20  # bytes per read request
Progress = Callable[[int, int], None]


@dataclass
class Shard:
    path: Path
    offset: int
    nbytes: int


@dataclass
class Index:
    raw: dict[str, Any]
    shards: list[Shard]
    tensors: list[dict[str, Any]]
    path: Path

    @property
    def total_bytes(self) -> int:
        return int(self.raw["total_bytes"])

    @classmethod
    def load(cls, files: dict[str, Path]) -> Index:
        path = files.get(INDEX)
        if path is None:
            raise FtwError(f"no {INDEX} among the model files")
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise FtwError(f"{path}: cannot read the FTW index: {e}") from None
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise FtwError(f"{path}: not an FTW index")
        if raw.get("version") != VERSION:
            raise FtwError(
                f"{path}: FTW version {raw.get('version')!r} is not supported "
                f"(this reader: {VERSION})"
            )
        if raw.get("align") != ALIGN:
            raise FtwError(f"{path}: alignment {raw.get('align')!r} is not {ALIGN}")
        shards = []
        for s in raw["shards"]:
            if s["file"] not in files:
                raise FtwError(f"{path}: shard {s['file']} is missing")
            shards.append(Shard(Path(files[s["file"]]), int(s["offset"]), int(s["nbytes"])))
        index = cls(raw, shards, raw["tensors"], Path(path))
        index.validate()
        return index

    def validate(self) -> None:
        pos = 0
        for s in self.shards:
            if s.offset != pos or s.offset % ALIGN or s.nbytes % ALIGN:
                raise FtwError(
                    f"{s.path}: shard at offset {s.offset} (+{s.nbytes}) is misaligned or "
                    "leaves a gap"
                )
            size = s.path.stat().st_size
            if size < s.nbytes:
                raise FtwError(
                    f"{s.path}: truncated: {size} bytes, the index says {s.nbytes} "
                    f"(data ends at logical offset {s.offset + size})"
                )
            pos += s.nbytes
        if pos != self.total_bytes:
            raise FtwError(
                f"{self.path}: shards hold {pos} bytes, total_bytes says {self.total_bytes}"
            )
        for t in self.tensors:
            off, n = int(t["offset"]), int(t["nbytes"])
            if off % ALIGN:
                raise FtwError(f"{self.path}: tensor {t['name']} starts at misaligned offset {off}")
            if off + round_up(n) > self.total_bytes:
                raise FtwError(f"{self.path}: tensor {t['name']} at offset {off} runs past the end")

    def segments(self, offset: int, length: int) -> list[tuple[Shard, int, int, int]]:
        """(shard, offset in shard, length, offset in the destination) pieces of a range."""
        out = []
        done = 0
        for s in self.shards:
            lo, hi = max(offset + done, s.offset), min(offset + length, s.offset + s.nbytes)
            if lo < hi:
                out.append((s, lo - s.offset, hi - lo, lo - offset))
                done = hi - offset
        return out


class _Files:
    """Open descriptors per shard: O_DIRECT where the filesystem allows it."""

    def __init__(self, shards: list[Shard], direct: bool):
        self.fds: dict[Path, int] = {}
        self.direct = direct and hasattr(os, "O_DIRECT")
        for s in shards:
            self.fds[s.path] = self._open(s.path)

    def _open(self, path: Path) -> int:
        if self.direct:
            try:
                return os.open(path, os.O_RDONLY | os.O_DIRECT)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                log.warning("%s: the filesystem refuses O_DIRECT; using buffered reads", path)
                self.direct = False
        return os.open(path, os.O_RDONLY)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)


def _pread_full(fd: int, view: memoryview, offset: int, path: Path, logical: int) -> None:
    while len(view):
        n = os.preadv(fd, [view], offset)
        if n <= 0:
            raise FtwError(
                f"{path}: unexpected end of file at offset {offset} (logical offset {logical})"
            )
        view, offset, logical = view[n:], offset + n, logical + n


@dataclass
class ReadPlan:
    mode: str  # "parallel" | "serial"
    workers: int
    reason: str


def choose_mode(need_bytes: int, available: int | None, workers: int) -> ReadPlan:
    """Parallel unless memory cannot hold the destination plus the reads in flight."""
    transient = workers * CHUNK * 2
    if workers <= 1:
        return ReadPlan("serial", 1, "one worker")
    if available is not None and available < need_bytes + transient:
        return ReadPlan(
            "serial", 1, f"{available >> 20} MiB available < {(need_bytes + transient) >> 20} MiB"
        )
    return ReadPlan("parallel", workers, "memory allows it")


def mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class HostMemoryError(FtwError):
    """A model's weights need more host memory than is available: refused with the numbers
    before anything is allocated, rather than the process killed half-way through a read."""


def require_host_memory(needed: int, what: str = "the model's weights") -> None:
    """Raises HostMemoryError where `needed` bytes exceed the memory available now (not
    checked where /proc/meminfo cannot say)."""
    available = mem_available()
    if available is not None and needed > available:
        raise HostMemoryError(
            f"{what} need {needed / 2**30:.1f} GiB of host memory and "
            f"{available / 2**30:.1f} GiB is available: free memory, or use a smaller or "
            "more quantized model"
        )


@dataclass
class LoadStats:
    mode: str = ""
    direct: bool = True
    bytes: int = 0
    seconds: float = 0.0  # the whole load: reads, and pins still running after them
    read_seconds: float = 0.0
    pin_seconds: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0


def read(
    files: dict[str, Path],
    *,
    workers: int = 8,
    mode: str = "auto",
    pin: bool | None = None,
    direct: bool = True,
    verify: bool = False,
    progress: Progress | None = None,
    stats: LoadStats | None = None,
    pin_before_fill: bool = False,
    experts: tuple[int, int] | None = None,
    dense: bool = True,
    huge_pages: bool | None = None,
) -> ModelWeights:
    """All tensors of an FTW model in host memory: dense by name, banks by (layer, bank).

    experts=(lo, hi) reads only rows [lo, hi) of every bank (one rank's share, freetoken.dist),
    and dense=False skips the dense tensors; nothing else is read or allocated.
    pin_before_fill exists only to measure what pin-after-fill saves: it registers every
    empty bank first, which faults in and zeroes each page before the read overwrites it.
    huge_pages asks for transparent huge pages in the destination mappings; None: where
    they fill faster than small pages (measured once per process).
    """
    index = Index.load(files)
    config = json.loads(Path(files["config.json"]).read_text())
    spans = {t["name"]: _span(t, experts) for t in index.tensors if dense or t["kind"] == "bank"}
    tensors = [t for t in index.tensors if t["name"] in spans]
    need = sum(end - start for start, end, _ in spans.values())
    require_host_memory(need)  # every byte is read into host memory, the banks to stay
    plan = choose_mode(need, mem_available(), workers) if mode == "auto" else None
    plan = plan or ReadPlan(mode, workers, "requested")
    pin = torch.cuda.is_available() if pin is None else pin
    stats = stats if stats is not None else LoadStats()
    if huge_pages is None:
        huge_pages = hostmem.huge_pages_pay()
    buffers = {name: HostBuffer(end - start, huge_pages) for name, (start, end, _) in spans.items()}
    fh = _Files(index.shards, direct)
    t0 = time.perf_counter()
    if pin and pin_before_fill:
        for t in (t for t in tensors if t["kind"] == "bank"):
            buffers[t["name"]].pin()
        stats.pin_seconds = time.perf_counter() - t0
    pinner = Pinner() if pin and not pin_before_fill else None
    try:
        _read_all(index, tensors, spans, fh, buffers, plan, pinner, progress, need)
    finally:
        fh.close()
    stats.read_seconds = time.perf_counter() - t0
    if pinner is not None:
        stats.pin_seconds = pinner.finish()
    # Pinning overlaps reading; the load is done when the last bank is pinned.
    stats.seconds = time.perf_counter() - t0
    stats.mode, stats.direct, stats.bytes = plan.mode, fh.direct, need
    how = "O_DIRECT" if fh.direct else "buffered"
    log.info(
        "read %.2f GB of FTW in %.2f s (%.2f GB/s, %s, %s)",
        *(need / 1e9, stats.seconds, stats.gbps, plan.mode, how),
    )
    return _weights(index, config, tensors, spans, buffers, verify)


def _weights(index, config, tensors, spans, buffers, verify: bool) -> ModelWeights:
    """The filled buffers as tensors: dense by name, banks by (layer, bank)."""
    weights = ModelWeights(config=config, source="ftw")
    for t in tensors:
        _, _, (skip, shape, nbytes) = spans[t["name"]]
        fmt = t.get("quant")
        if fmt:
            shape = _packed(index, t, shape, nbytes)
        tensor = buffers[t["name"]].tensor(t["dtype"], shape, nbytes, offset=skip)
        whole = nbytes == int(t["nbytes"])  # the CRC covers whole tensors only
        if verify and whole and zlib.crc32(buffers[t["name"]].view[:nbytes]) != t.get("crc32"):
            raise FtwError(
                f"{index.path}: tensor {t['name']} at offset {t['offset']} fails its CRC check"
            )
        key = (int(t["layer"]), t["bank"]) if t["kind"] == "bank" else t["name"]
        if t["kind"] == "bank":
            weights.banks[key] = tensor
        else:
            weights.dense[key] = tensor
        if fmt:
            weights.formats[key] = fmt
    return weights


def _packed(index: Index, t: dict[str, Any], shape: list[int], nbytes: int) -> list[int]:
    """The uint8 shape of a packed tensor's blocks, checked against its bytes."""
    try:
        packed = list(quant.get(t["quant"]).packed_shape(shape))
    except quant.QuantError as e:
        raise FtwError(f"{index.path}: tensor {t['name']}: {e}") from None
    if math.prod(packed) != nbytes or t["dtype"] != "uint8":
        raise FtwError(
            f"{index.path}: tensor {t['name']}: {nbytes} bytes of {t['dtype']} do not hold "
            f"{t['quant']} blocks of shape {shape}"
        )
    return packed


def _span(
    t: dict[str, Any], experts: tuple[int, int] | None
) -> tuple[int, int, tuple[int, list[int], int]]:
    """The aligned byte range of a tensor to read, and where in it the wanted bytes are:
    (start, end, (skip, shape, nbytes)). Direct I/O needs both ends on ALIGN boundaries."""
    nbytes, shape = int(t["nbytes"]), list(t["shape"])
    if t["kind"] != "bank" or experts is None:
        return 0, round_up(nbytes), (0, shape, nbytes)
    lo, hi = experts
    row = nbytes // shape[0]
    start = lo * row // ALIGN * ALIGN
    return start, round_up(hi * row), (lo * row - start, [hi - lo, *shape[1:]], (hi - lo) * row)


def _read_all(
    index: Index,
    tensors: list[dict],
    spans: dict[str, tuple],
    fh: _Files,
    buffers: dict[str, HostBuffer],
    plan: ReadPlan,
    pinner: Pinner | None,
    progress: Progress | None,
    total: int,
) -> None:
    jobs: list[tuple[dict, int, int]] = []  # (tensor, start, length) in buffer-relative bytes
    for t in tensors:
        first, end, _ = spans[t["name"]]
        jobs += [
            (t, start, min(CHUNK, end - first - start)) for start in range(0, end - first, CHUNK)
        ]
    remaining = {t["name"]: spans[t["name"]][1] - spans[t["name"]][0] for t in tensors}
    lock = threading.Lock()
    done = [0]

    def run(job: tuple[dict, int, int]) -> None:
        t, start, length = job
        view = buffers[t["name"]].view
        first = spans[t["name"]][0]  # where the buffer starts in the tensor
        for shard, off, n, dst in index.segments(int(t["offset"]) + first + start, length):
            _pread_full(
                fh.fds[shard.path],
                view[start + dst : start + dst + n],
                off,
                shard.path,
                shard.offset + off,
            )
        with lock:
            remaining[t["name"]] -= length
            finished = remaining[t["name"]] == 0
            done[0] += length
            d = done[0]
        if finished and pinner is not None and t["kind"] == "bank":
            pinner.submit(buffers[t["name"]])
        if progress is not None:
            progress(d, total)

    if plan.mode == "parallel":
        with ThreadPoolExecutor(plan.workers, thread_name_prefix="ftw-read") as ex:
            for f in [ex.submit(run, j) for j in jobs]:
                f.result()
    else:
        for j in jobs:
            run(j)
