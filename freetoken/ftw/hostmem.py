"""Host memory for weights: lazy page-aligned anonymous mappings, pinned after they are filled.

Registering an empty lazy mapping with CUDA would fault in and zero every page only for
the read to overwrite it; filling first and registering afterwards skips that pass.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import queue
import threading
import time

import torch

log = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int32": torch.int32,
    "int64": torch.int64,
}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}") from None


PROBE_BYTES = 64 << 20


@functools.cache
def huge_pages_pay() -> bool:
    """Whether transparent huge pages fill faster than 4 KiB pages here, measured now.

    A fresh mapping costs a fault and a zeroed page per 4 KiB, which a 16 GB bank load
    feels (0.85 of the raw read against 0.94 with huge pages, on one machine); but where
    memory is fragmented the kernel compacts before handing out a huge page, and that has
    been slower than small pages (2-3x on a small VM). So both are timed on a 64 MiB
    mapping, the faster of two tries each (the first compaction is paid once by any load).
    """
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[never]" in f.read():
                return False
    except OSError:
        return False
    small = min(_fault_seconds(False) for _ in range(2))
    huge = min(_fault_seconds(True) for _ in range(2))
    log.info(
        "first-touch of %d MiB: %.1f ms with 4 KiB pages, %.1f ms with huge pages",
        PROBE_BYTES >> 20,
        small * 1e3,
        huge * 1e3,
    )
    return huge < small


def _fault_seconds(huge: bool) -> float:
    import numpy as np

    mm = mmap.mmap(-1, PROBE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        if huge:
            mm.madvise(mmap.MADV_HUGEPAGE)
        pages = np.frombuffer(mm, dtype=np.uint8)
        t0 = time.perf_counter()
        pages[::4096] = 1  # one write per 4 KiB page: every fault, no copying
        seconds = time.perf_counter() - t0
        del pages
        return seconds
    finally:
        mm.close()


class HostBuffer:
    """A page-aligned anonymous mapping; pages are allocated when first written."""

    def __init__(self, nbytes: int, huge: bool = False):
        self.nbytes = nbytes
        self.mm = mmap.mmap(
            -1, max(nbytes, mmap.PAGESIZE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        )
        if huge and hasattr(mmap, "MADV_HUGEPAGE"):
            # transparent huge pages: one fault per 2 MiB instead of 512; the kernel falls
            # back to small pages when it has no free huge ones
            self.mm.madvise(mmap.MADV_HUGEPAGE)
        self.view = memoryview(self.mm)[:nbytes]
        self.pinned = False

    @property
    def address(self) -> int:
        return ctypes.addressof(ctypes.c_char.from_buffer(self.mm))

    def tensor(self, dtype: str, shape: list[int], nbytes: int, offset: int = 0) -> torch.Tensor:
        raw = (
            torch.frombuffer(self.mm, dtype=torch.uint8, count=nbytes, offset=offset)
            if nbytes
            else torch.empty(0, dtype=torch.uint8)
        )
        t = raw.view(torch_dtype(dtype)).reshape(shape)
        t._ft_host_buffer = self  # keeps the mapping alive as long as the tensor
        return t

    def pin(self) -> None:
        if self.pinned or not self.nbytes:
            return
        err = torch.cuda.cudart().cudaHostRegister(self.address, len(self.mm), 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister failed with error {int(err)}")
        self.pinned = True

    def __del__(self) -> None:
        # A mapping freed while still registered would make CUDA refuse the next mapping that
        # the kernel places at the same address ("already registered").
        if getattr(self, "pinned", False):
            try:
                torch.cuda.cudart().cudaHostUnregister(self.address)
            except Exception:  # interpreter shutdown: CUDA may already be gone
                pass


class Pinner:
    """Pins filled buffers on one background thread (registration is serialised by the driver)."""

    def __init__(self):
        self.q: queue.Queue[HostBuffer | None] = queue.Queue()
        self.seconds = 0.0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="pin", daemon=True)
        self.thread.start()

    def submit(self, buf: HostBuffer) -> None:
        self.q.put(buf)

    def _run(self) -> None:
        while (buf := self.q.get()) is not None:
            t0 = time.perf_counter()
            try:
                buf.pin()
            except BaseException as e:  # reported by finish(); reading goes on
                self.error = e
            self.seconds += time.perf_counter() - t0

    def finish(self) -> float:
        """Waits for every pin; returns the seconds spent pinning."""
        self.q.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.seconds
