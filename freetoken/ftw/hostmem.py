"""Host memory for weights: lazy page-aligned anonymous mappings, pinned after they are filled.

Registering an empty lazy mapping with CUDA would fault in and zero every page only for
the read to overwrite it; filling first and registering afterwards skips that pass.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import mmap
import queue
import resource
import threading
import time
from collections.abc import Iterator

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


@functools.cache
def huge_pages_pay_here() -> bool:
    """`huge_pages_pay`, measured once in this process: a benchmark's banks all sit on one
    kind of page. Timed anew for each bank, the verdict of a machine where the two are close
    could differ from one bank to the next, and a comparison of kernels with it."""
    return huge_pages_pay()


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
        """Registers the mapping with CUDA; PinRefused where the platform says no."""
        if self.pinned or not self.nbytes:
            return
        release_freed()
        err = _register(self.address, len(self.mm))
        if err == ALREADY_REGISTERED and _unregister(self.address) == 0:
            # a registration outlived the mapping that was here (freed where CUDA could not
            # be called): it still points at that mapping's old pages, so DMA through it
            # would read stale memory; it goes, and this mapping takes its place
            log.warning("a stale host registration at %#x was dropped", self.address)
            err = _register(self.address, len(self.mm))
        if err != 0:
            raise PinRefused(err, len(self.mm))
        self.pinned = True

    def __del__(self) -> None:
        # A mapping freed while still registered would make CUDA refuse the next mapping that
        # the kernel places at the same address ("already registered"). While a CUDA graph
        # is captured, unregistering is not allowed (it would fail and break the capture):
        # the mapping is kept until the capture ends.
        if getattr(self, "pinned", False):
            with _lock:
                if _holds:
                    _freed.append((self.address, self.mm))
                    return
            _unregister(self.address)


ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered

_lock = threading.Lock()
_holds = 0  # graph captures in progress (no CUDA call that synchronises may run)
_freed: list[tuple[int, mmap.mmap]] = []  # registered mappings freed meanwhile, kept mapped


@contextlib.contextmanager
def capturing() -> Iterator[None]:
    """Marks a CUDA graph capture: pinned buffers freed meanwhile (by any thread, by the
    garbage collector) unregister when the last capture ends, not inside it."""
    global _holds
    with _lock:
        _holds += 1
    try:
        yield
    finally:
        with _lock:
            _holds -= 1
        release_freed()


def release_freed() -> None:
    """Unregisters (and unmaps) the pinned buffers freed during captures, where none is in
    progress."""
    with _lock:
        if _holds or not _freed:
            return
        freed = _freed[:]
        _freed.clear()
    for address, _ in freed:
        _unregister(address)


def _register(address: int, nbytes: int) -> int:
    """cudaHostRegister's error code (0: pinned); a seam for tests without a GPU."""
    return int(torch.cuda.cudart().cudaHostRegister(address, nbytes, 0))


def _unregister(address: int) -> int:
    """cudaHostUnregister's error code; a seam for tests without a GPU."""
    try:
        return int(torch.cuda.cudart().cudaHostUnregister(address))
    except Exception:  # interpreter shutdown: CUDA may already be gone
        return -1


def memlock_limit() -> int | None:
    """RLIMIT_MEMLOCK's soft limit in bytes; None: unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else soft


class PinRefused(RuntimeError):
    """cudaHostRegister said no: a memlock limit, a pin quota (WSL), a driver's refusal."""

    def __init__(self, code: int, nbytes: int):
        limit = memlock_limit()
        where = "no memlock limit" if limit is None else f"memlock limit {limit / 2**20:.0f} MiB"
        super().__init__(
            f"cudaHostRegister of {nbytes / 2**20:.0f} MiB failed with error {code} ({where})"
        )
        self.code = code


_refused: PinRefused | None = None


def refused() -> PinRefused | None:
    """Why pinning was refused in this process (later buffers are not tried), or None."""
    return _refused


class Pinner:
    """Pins filled buffers on one background thread (registration is serialised by the driver).

    A refused registration is not a failed load: the first refusal is kept (`refused`) and
    the buffers stay pageable; the caller serves them through a pinned staging ring.
    """

    def __init__(self):
        self.q: queue.Queue[HostBuffer | None] = queue.Queue()
        self.seconds = 0.0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="pin", daemon=True)
        self.thread.start()

    def submit(self, buf: HostBuffer) -> None:
        self.q.put(buf)

    def _run(self) -> None:
        global _refused
        while (buf := self.q.get()) is not None:
            if _refused is not None:
                continue
            t0 = time.perf_counter()
            try:
                buf.pin()
            except PinRefused as e:
                _refused = e
                log.warning("pinning refused: %s; host banks stay pageable", e)
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


class StagingRing:
    """Pinned slots through which pageable host memory reaches the GPU, where pinning the
    banks themselves was refused.

    A copy from pageable memory is synchronous and goes through the driver's own small
    bounce buffer; here the host copies one slot-sized piece into a free pinned slot while
    the GPU takes the previous piece, so a fetch still overlaps and the copy engine still
    sees pinned memory. A slot is reused once the copy out of it has completed.
    """

    def __init__(self, device: torch.device, slot_bytes: int = 16 << 20, slots: int = 4):
        self.cuda = device.type == "cuda"
        self.slots = [
            torch.empty(slot_bytes, dtype=torch.uint8, pin_memory=self.cuda) for _ in range(slots)
        ]
        self._done: list[torch.cuda.Event | None] = [None] * slots
        self._next = 0
        self.bytes = 0

    @property
    def nbytes(self) -> int:
        return sum(s.numel() for s in self.slots)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst (on the device, contiguous) <- src (pageable host memory), queued on the
        current stream."""
        s = src.contiguous().reshape(-1).view(torch.uint8)
        d = dst.view(-1).view(torch.uint8)
        size = self.slots[0].numel()
        for off in range(0, s.numel(), size):
            k = min(size, s.numel() - off)
            i, self._next = self._next, (self._next + 1) % len(self.slots)
            if self._done[i] is not None:
                self._done[i].synchronize()
            slot = self.slots[i][:k]
            slot.copy_(s[off : off + k])
            d[off : off + k].copy_(slot, non_blocking=self.cuda)
            if self.cuda:
                self._done[i] = torch.cuda.Event()
                self._done[i].record()
        self.bytes += s.numel()

    def measure(self, device: torch.device, nbytes: int = 64 << 20) -> float:
        """Bytes a second from pageable memory to `device` through the ring: what a miss
        costs here, for the warning and for the split's B_P."""
        src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.copy(dst, src)  # warm: first touches, the copy engine's start
        if self.cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        self.copy(dst, src)
        if self.cuda:
            torch.cuda.synchronize(device)
        return nbytes / max(time.perf_counter() - t0, 1e-9)
