"""A group of CPU ranks: devices from the settings, and a rank that dies taking the group down."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from freetoken import dist
from freetoken.runtime import loader
from tests.dist.util import backend, dist_engine
from tests.runtime.engine_util import files_of, full_logits

PROMPT = [5, 17, 99, 3, 250]


def _gone(pid: int) -> bool:
    """Exited (a zombie waiting for its new parent counts as exited)."""
    try:
        return "Z" in next(
            l for l in Path(f"/proc/{pid}/status").read_text().splitlines() if l.startswith("State")
        )
    except (FileNotFoundError, StopIteration):
        return True


def test_devices_from_the_settings():
    assert dist.devices("cpu:3", "auto") == ["cpu"] * 3
    assert dist.devices("auto", "cpu") == ["cpu"]
    with pytest.raises(
        ValueError, match="FREETOKEN_GPUS=0,1 names GPUs, but FREETOKEN_DEVICE is cpu"
    ):
        dist.devices((0, 1), "cpu")
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert dist.devices("auto", "auto") == ([f"cuda:{i}" for i in range(visible)] or ["cpu"])
    with pytest.raises(ValueError, match=f"names GPU {visible}, but {visible} are visible"):
        dist.devices((visible,), "auto")


def test_killing_a_follower_ends_the_group_with_its_exit_status(tiny_model):
    path, _ = tiny_model
    engine = dist_engine(path, 3)
    group = backend(engine).group
    try:
        full_logits(engine, PROMPT)
        victim, other = group.procs[1], group.procs[0]
        os.kill(victim.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(
            dist.RankDied, match=rf"rank 2 \(pid {victim.pid}, cpu\) exited with status -9"
        ):
            full_logits(engine, PROMPT)
        assert time.monotonic() - t0 < 5
        assert other.poll() is not None, "the other follower was ended too"
        with pytest.raises(dist.RankDied, match="rank 2"):  # and the group stays down
            full_logits(engine, PROMPT)
    finally:
        backend(engine).close()
    # this process can lead a new group afterwards
    engine = dist_engine(path, 2)
    try:
        full_logits(engine, PROMPT)
    finally:
        backend(engine).close()


RANK0 = """
import os, signal, sys
from pathlib import Path
from freetoken import dist
from freetoken.runtime import loader
files = {p.name: p for p in Path(sys.argv[1]).iterdir() if p.is_file()}
placement = loader.Placement("adaptive", 0, None, 0)
group = dist.launch(["cpu"] * 3, files, placement)
loaded = loader.load(files, "cpu", "auto", experts=group.experts)
experts = loader.place_experts(loaded, placement, group)
if sys.argv[2] == "awake":
    experts.warm()  # the followers now wait on the data group, not the control group
print(*(p.pid for p in group.procs), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_followers_exit_when_rank_0_dies(tiny_model):
    path, _ = tiny_model
    out = subprocess.run(
        [sys.executable, "-c", RANK0, str(path), "awake"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )  # it kills itself
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 2, out.stderr
    deadline = time.monotonic() + 5
    while not all(_gone(p) for p in pids):
        assert time.monotonic() < deadline, "a follower outlived rank 0"
        time.sleep(0.05)


def test_a_rank_that_fails_to_load_fails_the_load_by_name(tiny_model):
    path, _ = tiny_model
    files = files_of(path)
    # 8 experts over 2 ranks, 4 each: both layers resident need 8 slots on each
    placement = loader.Placement("resident", 0, None, 7)
    group = dist.launch(["cpu"] * 2, files, placement)
    loaded = loader.load(files, "cpu", "auto", experts=group.experts)
    with pytest.raises(
        RuntimeError,
        match=r"rank 0 \(cpu\): ValueError: the resident policy needs 8 expert slots"
        r".*; rank 1 \(cpu\): ValueError",
    ):
        loader.place_experts(loaded, placement, group)
    assert all(p.poll() is not None for p in group.procs)


def test_cuda_asked_of_a_torch_without_a_gpu_says_what_to_do(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(ValueError, match="CPU-only build: install a CUDA build of torch"):
        dist.devices("auto", "cuda")
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    with pytest.raises(ValueError, match=r"torch \(CUDA 12.8\) sees no GPU"):
        dist.devices("auto", "cuda")
