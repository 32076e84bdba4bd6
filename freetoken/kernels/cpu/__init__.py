"""The CPU expert kernel: a torch C++ extension compiled on first use (cached per machine).

Where no compiler is available the plain-torch reference runs instead, and the log says so.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

# Imported here, with this module, never first inside `extension()`: importing it imports
# setuptools, which inserts and removes an entry of sys.meta_path; done on the engine thread
# while another thread imports, that skips the path finder for the other thread's import
# (a runner failed to start with "No module named 'socketserver'").
import torch.utils.cpp_extension  # noqa: F401

from freetoken.kernels import reference

if TYPE_CHECKING:  # kernels sit below models: the spec is read, never built, here
    from freetoken.models.base import ExpertSpec

log = logging.getLogger(__name__)

TIERS = ("scalar", "avx2", "avx512", "avx512-bf16")
_lock = threading.Lock()
_ext = None
_failed = False


SOURCES = (
    "moe_experts.cpp",
    "float_dot.cpp",
    "quant_dot.cpp",
    "quant_avx512.cpp",
    "quant_act.cpp",
    "quant_vnni.cpp",
    "quant_avx2.cpp",
    "lane.cpp",
)
HEADERS = (
    "quant_scales.h",
    "quant_vnni.h",
    "quant_vnni_k.h",
)  # included by the sources: copied beside them


def _files() -> tuple[list[Path], list[Path]]:
    """The sources and the headers they include, from this package."""
    here = Path(__file__)
    return [here.with_name(n) for n in SOURCES], [here.with_name(n) for n in HEADERS]


def _build_dir(sources: list[Path]) -> Path:
    from freetoken import config

    # keyed by the sources' content: checkouts of different versions never rebuild each other's
    digest = hashlib.sha256(b"".join(s.read_bytes() for s in sources)).hexdigest()[:12]
    d = config.current().cache_dir / "kernels" / f"torch-{torch.__version__}" / digest
    d.mkdir(parents=True, exist_ok=True)
    return d


def _sources_in(build: Path, sources: list[Path]) -> list[str]:
    """The sources, copied into the build directory: ninja rebuilds when a source's path
    changes, and checkouts with the same sources (the directory is keyed by their content)
    would otherwise rebuild each other's kernel, a minute or more each time."""
    out = []
    for src in sources:
        dst = build / src.name
        if not dst.exists() or dst.read_bytes() != src.read_bytes():
            tmp = dst.with_suffix(".tmp")
            tmp.write_bytes(src.read_bytes())
            tmp.replace(dst)
        out.append(str(dst))
    return out


@contextlib.contextmanager
def _exclusive(build: Path) -> Iterator[None]:
    """One build at a time in `build`, across processes. The lock is the kernel's (flock), so
    it goes with a process that dies: a lock whose holder is gone is free at once, never
    waited on. torch's own lock file would outlive a killed build and be waited on for ever,
    so it is removed while this one is held (no build of ours runs then)."""
    with open(build / "freetoken.lock", "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a live build in another process: its result is ours too
            f.seek(0)
            holder = f.read().strip() or "another process"
            log.info("waiting for the CPU kernel build of %s", holder)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            f.truncate(0)
            f.write(f"process {os.getpid()}")
            f.flush()
            (build / "lock").unlink(missing_ok=True)
            yield
        finally:
            f.truncate(0)
            fcntl.flock(f, fcntl.LOCK_UN)


@dataclass(frozen=True)
class Status:
    """Which code computes experts on the CPU, and why: for `freetoken doctor` and the log."""

    kernel: str  # "C++ (avx512)", or "plain torch"
    reason: str

    @property
    def compiled(self) -> bool:
        return self.kernel != "plain torch"


_status: Status | None = None


def ninja_dir() -> Path | None:
    """The folder of this environment's ninja: the `ninja` package's, else one beside this
    Python. None: only a ninja on PATH, if any, is left to torch's build."""
    try:
        import ninja

        candidates = [Path(ninja.BIN_DIR)]
    except (ImportError, AttributeError):
        candidates = []
    candidates.append(Path(sys.executable).parent)
    return next((d for d in candidates if (d / "ninja").is_file()), None)


def extension():
    """The compiled module, or None where it cannot be built (status() says why)."""
    global _ext, _failed, _status
    if _ext is not None or _failed:
        return _ext
    with _lock:
        if _ext is None and not _failed:
            try:
                _ext, how = _build()
                _status = Status(f"C++ ({TIERS[_ext.cpu_tier()]})", how)
            except Exception as e:  # no compiler, no headers: keep serving with plain torch
                _failed = True
                reason = (str(e).splitlines() or [type(e).__name__])[0]
                _status = Status("plain torch", f"the C++ kernel did not build: {reason}")
                log.warning("CPU expert kernel unavailable (%s); using plain torch", reason)
    return _ext


def _build():
    from torch.utils.cpp_extension import load

    from freetoken import config

    tools = ninja_dir()
    if tools is not None:
        # torch's build calls `ninja` by name: this environment's goes first, so two ninjas
        # of different versions never rebuild each other's output
        config.put_first_on_path(tools)
    srcs, headers = _files()
    build = _build_dir(srcs + headers)
    fresh = not any(build.glob("*.so"))
    if fresh:
        log.warning(
            "building CPU kernels, first start only (a minute or more; "
            "`freetoken doctor --build` does it ahead)"
        )
    t0 = time.perf_counter()
    with _exclusive(build):
        _sources_in(build, headers)
        ext = load(
            name="freetoken_cpu_moe",
            sources=_sources_in(build, srcs),
            build_directory=str(build),
            extra_cflags=["-O3", "-fopenmp", "-std=c++17"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    ninja = f"ninja from {tools}" if tools else "ninja from PATH"
    if fresh:
        return ext, f"compiled in {time.perf_counter() - t0:.0f}s into {build} ({ninja})"
    return ext, f"built for this machine in {build}"


def peek() -> Status:
    """status() where the kernel is built already (loading it takes a second); otherwise
    what the first load would do, without building it."""
    if _status is not None:
        return _status
    srcs, headers = _files()
    build = _build_dir(srcs + headers)
    if any(build.glob("*.so")):
        return status()
    return Status(
        "not built yet",
        "the first load builds it (a minute or more); `freetoken doctor --build` does it now",
    )


def status() -> Status:
    """Builds the kernel if it is not built yet, then says which code serves the CPU side."""
    extension()
    assert _status is not None
    return _status


def physical_cpus() -> list[int]:
    """One logical CPU of each physical core this process may run on, lowest numbers first."""
    allowed = sorted(os.sched_getaffinity(0))
    cores: dict[tuple[str, str], int] = {}
    for cpu in allowed:
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            key = (
                topo.joinpath("physical_package_id").read_text().strip(),
                topo.joinpath("core_id").read_text().strip(),
            )
        except OSError:  # no topology to read: every allowed CPU counts as a core
            return allowed
        cores.setdefault(key, cpu)
    return sorted(cores.values())


def tier() -> str:
    ext = extension()
    return TIERS[ext.cpu_tier()] if ext is not None else "torch"


def int8_activations(compute_dtype: torch.dtype) -> bool:
    """Whether packed banks may take their activations quantized to int8 for a model that
    computes in `compute_dtype`: in BF16, whose activations carry 8 significant bits, the
    integer kernels' error (8-bit codes with a scale per 32: about 0.5% of a dot product, 1%
    of an expert's output) is of the order of the model's own rounding; fp32 and fp16 models
    keep exact activations (the tests compare fp32 models with transformers token by token)."""
    return compute_dtype == torch.bfloat16


def moe_experts(
    x: torch.Tensor,
    banks: reference.Banks,
    tok: torch.Tensor,
    exp: torch.Tensor,
    weights: torch.Tensor,
    spec: ExpertSpec,
    out: torch.Tensor | None = None,
    isa: str | None = None,
    compute_dtype: torch.dtype = torch.float32,
    first_row: int = 0,
) -> torch.Tensor:
    """out[t] += Σ_r weights[r] · expert[exp[r]](x[tok[r]]) over the routes r, in fp32.

    x: [T, H]; `banks` one layer's (reference.py names them) in host memory: bf16 or fp32,
    or packed in the block format `spec` gives each (read in place); `spec` what each expert
    computes; `compute_dtype` the model's (see int8_activations: with AVX-512 VNNI, packed
    banks of a BF16 model take int8 activations; with AVX2, those of the formats
    `quant_avx2.cpp` reads do). `first_row`: only each expert's intermediate rows from it
    on (their down bias included): the GPU computes the rows before it (a miss split by its
    rows; reference.expert_rows).
    """
    xf = x.float().contiguous()
    out = torch.zeros_like(xf) if out is None else out
    ext = extension()
    if ext is None or isa == "torch":
        for t, e, w in zip(tok.tolist(), exp.tolist(), weights.tolist()):
            rows = reference.expert_weights(banks, e, spec, torch.float32)
            if first_row:
                rows = reference.expert_rows(rows, first_row, spec.intermediate, down_bias=True)
            out[t] += w * reference.expert_ffn(xf[t : t + 1], rows, spec)[0]
        return out
    level = -1 if isa is None else TIERS.index(isa)
    ext.moe_experts(
        xf,
        banks["gate_up"],
        banks["down"],
        banks.get("gate_up_bias"),
        banks.get("down_bias"),
        tok.to(torch.int64).contiguous(),
        exp.to(torch.int64).contiguous(),
        weights.float().contiguous(),
        out,
        level,
        spec.activation_code,
        spec.alpha,
        spec.limit,
        spec.format_code("gate_up"),
        spec.format_code("down"),
        int8_activations(compute_dtype),
        first_row,
    )
    return out
