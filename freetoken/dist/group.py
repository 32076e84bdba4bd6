"""The ranks of one runner: a process per GPU under torch.distributed, rank 0 leading.

Rank 0 is the runner process the server talks to. `launch` starts ranks 1..N-1 (the
followers, `python -m freetoken.dist.follower`) as its child processes, and all of them join
two process groups: the data group (NCCL between GPUs, gloo between CPU ranks) carries each
operation's tensors; the control group (gloo) carries headers while rank 0 is idle and
small Python objects (load status, stats, resize results).

Rank 0 sends a header [op, a, b, c] before every operation; followers wait for it. While a
model is serving, headers travel on the data group (microseconds on NCCL). When rank 0
goes idle it says so (IDLE), and the next header travels on the control group, where a
waiting follower sits in a socket read with no timeout instead of in an NCCL kernel that
would spin on its GPU for as long as the model stays loaded.

A rank that dies takes the group down. Rank 0 watches its followers' processes and, when
one exits unexpectedly, kills the others and calls `on_death` (the runner exits, so the
server reports it and starts a fresh runner on the next request); operations on a broken
group raise RankDied. Followers exit as soon as rank 0 is gone.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from freetoken import config as settings
from freetoken.models.hub import num_experts

log = logging.getLogger(__name__)

DATA_TIMEOUT = timedelta(minutes=10)  # the rendezvous, and any one collective inside a step
IDLE_TIMEOUT = timedelta(
    days=3650
)  # a follower waits for rank 0's next header for as long as it takes
WATCH_S = 0.1
EXIT_FOLLOWED = 3  # a follower's exit status when it leaves because another rank failed

# header ops
STOP, EXPERTS, IDLE, RESIZE, STATS, WARM = range(6)


class RankDied(RuntimeError):
    """A rank exited, or an operation failed half-way: the group cannot go on."""


def devices(gpus: str | tuple[int, ...], device: str) -> list[str]:
    """The device of each rank from FREETOKEN_GPUS and FREETOKEN_DEVICE; rank 0's comes first."""
    if isinstance(gpus, str) and gpus.startswith("cpu:"):
        return ["cpu"] * int(gpus.removeprefix("cpu:"))
    if device == "cpu":
        if gpus != "auto":
            raise ValueError(
                f"FREETOKEN_GPUS={','.join(map(str, gpus))} names GPUs, but FREETOKEN_DEVICE is cpu"
            )
        return ["cpu"]
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "cuda" and count == 0:
        raise ValueError(no_gpu_reason())
    if gpus == "auto":
        return [f"cuda:{i}" for i in range(count)] or ["cpu"]
    missing = [i for i in gpus if i >= count]
    if missing:
        raise ValueError(f"FREETOKEN_GPUS names GPU {missing[0]}, but {count} are visible")
    return [f"cuda:{i}" for i in gpus]


def no_gpu_reason() -> str:
    """Why FREETOKEN_DEVICE=cuda cannot be had here, in words a user can act on."""
    if torch.version.cuda is None:
        return (
            f"FREETOKEN_DEVICE=cuda, but this torch ({torch.__version__}) is a CPU-only build: "
            "install a CUDA build of torch (packaging/install.sh picks one where it finds a GPU), "
            "or unset FREETOKEN_DEVICE to serve on the CPU"
        )
    return (
        f"FREETOKEN_DEVICE=cuda, but torch (CUDA {torch.version.cuda}) sees no GPU: check the "
        "driver (nvidia-smi) and CUDA_VISIBLE_DEVICES, or unset FREETOKEN_DEVICE"
    )


def use(device: str) -> torch.device:
    """Makes `device` this process's device ("cuda" then means it) and returns it."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is not None:
        torch.cuda.set_device(d)
    return d


def share(num_experts: int, world: int, rank: int) -> tuple[int, int]:
    """The experts [lo, hi) of every MoE layer that `rank` owns: contiguous blocks, the first
    E % world ranks one expert more, so each rank reads one run of rows from every bank."""
    if num_experts < world:
        raise ValueError(f"{num_experts} experts per layer cannot be spread over {world} ranks")
    base, extra = divmod(num_experts, world)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (rank < extra)


class Group:
    def __init__(
        self,
        rank: int,
        devices: list[str],
        workdir: Path,
        num_experts: int,
        on_death: Callable[[str], None] | None = None,
    ):
        self.rank, self.devices, self.world = rank, list(devices), len(devices)
        self.device = torch.device(devices[rank])
        self.experts = share(num_experts, self.world, rank)
        self.workdir = Path(workdir)
        self.on_death = on_death
        self.procs: list[subprocess.Popen] = []  # rank 0: the followers, rank r at [r - 1]
        self.awake = False  # followers wait on the data group (True) or the control group
        self.dead: str | None = None
        self.closing = False
        self.ctrl = None
        self._lock = threading.Lock()
        self._threads = torch.get_num_threads()

    def join(self) -> None:
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        store = dist.FileStore(str(self.workdir / "store"), self.world)
        extra = {"device_id": self.device} if backend == "nccl" else {}
        dist.init_process_group(
            backend,
            store=store,
            rank=self.rank,
            world_size=self.world,
            timeout=DATA_TIMEOUT,
            **extra,
        )
        self.ctrl = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        # the ranks share the host's cores (CPU experts): an equal share each
        torch.set_num_threads(max(1, self._threads // self.world))

    # --- headers ----------------------------------------------------------------------
    def send(self, op: int, a: int = 0, b: int = 0, c: int = 0) -> None:
        """Rank 0: the header of the next operation, to every follower."""
        header = torch.tensor([op, a, b, c], dtype=torch.int64)
        if self.awake:
            dist.broadcast(header.to(self.device), 0)
        else:
            dist.broadcast(header, 0, group=self.ctrl)
        self.awake = op not in (IDLE, STOP)

    def recv(self) -> list[int]:
        """A follower: waits for rank 0's next header."""
        if self.awake:
            header = torch.empty(4, dtype=torch.int64, device=self.device)
            dist.broadcast(header, 0)
        else:
            header = torch.empty(4, dtype=torch.int64)
            dist.broadcast(header, 0, group=self.ctrl)
        out = header.tolist()
        self.awake = out[0] not in (IDLE, STOP)
        return out

    # --- collectives --------------------------------------------------------------------
    def broadcast(self, t: torch.Tensor) -> None:
        dist.broadcast(t, 0)

    def reduce(self, t: torch.Tensor) -> None:
        """Sums `t` over the ranks into rank 0's."""
        dist.reduce(t, 0, op=dist.ReduceOp.SUM)

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj` at rank 0 (a list in rank order); None on followers."""
        out = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.ctrl)
        return out

    @contextlib.contextmanager
    def op(self) -> Iterator[None]:
        """Rank 0: one operation of the whole group. An error half-way leaves the followers
        somewhere in the middle of it, so the group is broken for good: RankDied."""
        if self.dead is not None:
            raise RankDied(self.dead)
        try:
            yield
        except Exception as e:
            # a collective fails as soon as a peer's socket closes, often before its process
            # is seen to exit: give it a moment, the exit status is the clearer reason
            deadline = time.monotonic() + 2.0
            while self.dead is None and self._exited() is None and time.monotonic() < deadline:
                time.sleep(0.02)
            self._broken(
                self._exited()
                or f"rank 0 failed in the middle of an operation: {type(e).__name__}: {e}"
            )
            raise RankDied(self.dead) from e

    # --- life and death -------------------------------------------------------------------
    def _exited(self) -> str | None:
        """Why the group is broken, if a follower has exited: the first to fail on its own
        rather than one that left because another did."""
        gone = [(r, p, p.poll()) for r, p in enumerate(self.procs, 1) if p.poll() is not None]
        gone.sort(key=lambda g: g[2] == EXIT_FOLLOWED)
        for r, p, code in gone[:1]:
            return f"rank {r} (pid {p.pid}, {self.devices[r]}) exited with status {code}"
        return None

    def _watch(self) -> None:
        while not self.closing and self.dead is None:
            why = self._exited()
            if why is not None and not self.closing:
                self._broken(why)
                return
            time.sleep(WATCH_S)

    def _broken(self, why: str) -> None:
        with self._lock:  # the watcher and an operation may both find the group broken
            if self.dead is not None:
                return
            log.error("%s; the group stops", why)
            self.kill()
            self.dead = why
        if self.on_death is not None:
            self.on_death(why)

    def kill(self) -> None:
        """Ends every follower now."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)

    def close(self) -> None:
        """Rank 0: stops the followers (STOP, or a kill when the group is broken) and leaves
        the group."""
        if self.closing:
            return
        self.closing = True
        if self.dead is None and dist.is_initialized():
            try:
                self.send(STOP)
                # leave with the followers, not after them: NCCL's teardown may wait for its peers
                self.leave()
                for p in self.procs:
                    p.wait(timeout=10)
            except Exception as e:  # a follower that does not stop in time is killed below
                log.warning("followers did not stop cleanly: %s", e)
        self.kill()
        self.leave()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def abort(self, why: str, leave: bool = True) -> None:
        """Rank 0: ends the followers at once, wherever they are (rank 0's load failed, or the
        process exits: then leave=False, nothing that could wait runs)."""
        if self.closing:
            return
        self.dead = self.dead or why
        self.closing = True
        self.kill()
        if leave:
            self.leave()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def leave(self) -> None:
        if dist.is_initialized():
            if self.dead is None:
                dist.destroy_process_group()
            else:
                # a collective may still wait on a dead peer; abort instead of waiting for it
                with contextlib.suppress(Exception):
                    dist.distributed_c10d._abort_process_group()
        torch.set_num_threads(self._threads)


def launch(
    devices: list[str],
    files: dict[str, Path],
    placement: Any,
    dtype: str = "auto",
    on_death: Callable[[str], None] | None = None,
) -> Group:
    """Rank 0: starts a follower for each device after the first and joins the group with them.

    The followers load their share of the experts of `files` with `placement` (per GPU)
    while rank 0 loads its own; `freetoken.dist.experts.install` waits for them. They also
    read FREETOKEN_* from the environment they inherit.
    """
    settings.export_rank_env()
    config = json.loads(Path(files["config.json"]).read_text())
    workdir = Path(tempfile.mkdtemp(prefix="freetoken-ranks-"))
    placement = dataclasses.asdict(placement)
    placement["cache_dir"] = str(placement["cache_dir"]) if placement.get("cache_dir") else None
    spec = {
        "files": {k: str(v) for k, v in files.items()},
        "placement": placement,
        "dtype": dtype,
        "devices": devices,
    }
    (workdir / "spec.json").write_text(json.dumps(spec))
    group = Group(0, devices, workdir, num_experts(config), on_death)
    try:
        for rank in range(1, len(devices)):
            cmd = [
                sys.executable,
                "-m",
                "freetoken.dist.follower",
                str(workdir),
                str(rank),
                str(os.getpid()),
            ]
            group.procs.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL))
        threading.Thread(target=group._watch, name="ranks-watch", daemon=True).start()
        group.join()
    except BaseException:
        group.abort("rank 0 could not start the group")
        raise
    # at exit the engine thread may still be inside an operation: no STOP, just end the followers
    atexit.register(group.abort, "the runner exits", leave=False)
    log.info(
        "%d ranks on %s (pids %s)",
        len(devices),
        ", ".join(devices),
        ", ".join(str(p) for p in [os.getpid(), *(p.pid for p in group.procs)]),
    )
    return group


def watch_parent(parent_pid: int) -> None:
    """A follower: exits as soon as rank 0 (its parent) is gone, however it went."""
    while os.getppid() == parent_pid:
        time.sleep(WATCH_S)
    os._exit(EXIT_FOLLOWED)
