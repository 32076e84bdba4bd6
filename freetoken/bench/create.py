"""`freetoken bench create`: `freetoken create` of a synthetic checkpoint through a server on
loopback, against the time to read the checkpoint and write its FTW at this disk's speed.

A random Qwen3-MoE checkpoint of about --mib MiB (bf16, 32 experts a layer, in shards of 5
GB as the Hub's are) is written once into --work. A `freetoken serve` over a fresh store
there takes each create as the CLI sends it:
  in place  the server reads the files where they are (a server on this machine)
  upload    the files are hashed and uploaded over HTTP first (a remote server's path)
Around each create, in the same run, the checkpoint's files are read (as the create finds
them: whatever of them is in the page cache stays there) and as many bytes are written to a
file on the store's filesystem and fsynced; the baseline is the mean of the reads and
writes before and after it. Each row gives create / (read + write), the goal being 1.3 at
most, and what the store then holds against the FTW alone (goal: 1.05 at most).
Where the store's filesystem has a block device, the device's own counters say how much of
the create it was busy, and how fast it wrote while busy against the write baseline.

The server keeps a converter started ahead (FREETOKEN_WARM_START), so a create skips the
converter's start-up (a Python importing torch: seconds where CUDA's libraries load).
--cold adds rows from a server without it; the start-up is measured on its own, and a cold
row's last column is its ratio without it.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from freetoken.bench import common, served
from freetoken.cli.client import Client
from freetoken.cli.create import create
from freetoken.cli.progress import Progress

_EXPERT_LAYER = {  # one layer: 32 experts of 3 x 1024 x 512 bf16 (~100 MB) plus attention
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "moe_intermediate_size": 512,
    "num_experts": 32,
    "num_experts_per_tok": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 128,
}
_LAYER_BYTES = 32 * 3 * 1024 * 512 * 2 + 2 * (8 + 4) * 128 * 1024 * 2
_CHUNK = 8 << 20
_SHARD = 5 * 10**9  # Hugging Face's default largest shard: a checkpoint larger than RAM fits


def checkpoint(work: Path, mib: int) -> Path:
    """The synthetic checkpoint of about `mib` MiB, written once."""
    from freetoken.tools import synth

    layers = max(1, round(mib * 2**20 / _LAYER_BYTES))
    out = work / "checkpoints" / f"create-{layers}l"
    if (out / "config.json").exists():
        return out
    partial = out.with_name(out.name + ".partial")
    synth.write_qwen3_moe(
        partial, dtype="bfloat16", num_hidden_layers=layers, shard_bytes=_SHARD, **_EXPERT_LAYER
    )
    partial.rename(out)
    return out


def read_seconds(files: list[Path]) -> float:
    """Reads the files through, one reused buffer, nothing kept."""
    buf = bytearray(_CHUNK)
    t0 = time.perf_counter()
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    return time.perf_counter() - t0


def write_seconds(directory: Path, nbytes: int) -> float:
    """Writes `nbytes` to a new file in `directory` and fsyncs it, as the converter does."""
    block = os.urandom(_CHUNK)
    path = directory / ".bench-write"
    t0 = time.perf_counter()
    try:
        with open(path, "wb") as f:
            left = nbytes
            while left > 0:
                left -= f.write(block[: min(left, _CHUNK)])
            f.flush()
            os.fsync(f.fileno())
        return time.perf_counter() - t0
    finally:
        path.unlink(missing_ok=True)


def disk_usage(root: Path) -> int:
    """Bytes of every file under `root`, a file with several links counted once."""
    seen, total = set(), 0
    for dirpath, _, names in os.walk(root):
        for name in names:
            st = os.lstat(os.path.join(dirpath, name))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def disk_counters(path: Path) -> tuple[float, int] | None:
    """The block device holding `path`: (seconds it has been busy, bytes written) since boot,
    from /sys/dev/block (Linux); None where the filesystem has no block device of its own."""
    st = os.stat(path)
    stat = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/stat")
    try:
        fields = stat.read_text().split()
    except OSError:
        return None
    # fields 7 and 10 (from 1): sectors written (512 bytes) and milliseconds spent doing I/O
    return int(fields[9]) / 1e3, int(fields[6]) * 512


def converter_start() -> float:
    """Seconds for a Python to import the converter (torch with it), as each create's does."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import freetoken.ftw.convert"], check=True)
    return time.perf_counter() - t0


def one_create(url: str, store: Path, source: Path, in_place: bool) -> dict[str, Any]:
    """Times one create into an empty store; measures what the store holds, then deletes."""
    files = sorted(p for p in source.iterdir() if p.is_file())
    nbytes = sum(p.stat().st_size for p in files)
    modelfile = source.parent / f"{source.name}.Modelfile"
    modelfile.write_text(f"FROM ./{source.name}\n")
    before = (read_seconds(files), write_seconds(store, nbytes))
    client = Client(url)
    disk0, t0 = disk_counters(store), time.perf_counter()
    create(client, "bench", modelfile, Progress(io.StringIO(), tty=False), in_place=in_place)
    seconds, disk1 = time.perf_counter() - t0, disk_counters(store)
    show = client.call("POST", "/api/show", {"model": "bench"})
    ftw = sum(int(x["size"]) for x in _layers(store) if x.get("name"))
    held = disk_usage(store)
    after = (read_seconds(files), write_seconds(store, nbytes))
    client.call("DELETE", "/api/delete", {"model": "bench"})
    read = (before[0] + after[0]) / 2
    write = (before[1] + after[1]) / 2
    return {
        "path": "in place" if in_place else "upload",
        "format": show["details"]["format"],
        "source_mb": nbytes / 1e6,
        "ftw_mb": ftw / 1e6,
        "store_mb": held / 1e6,
        "store_over_ftw": held / ftw,
        "seconds": seconds,
        "read_s": read,
        "write_s": write,
        "ratio": seconds / (read + write),
    } | _disk_columns(disk0, disk1, seconds, nbytes / write)


def _disk_columns(
    before: tuple[float, int] | None, after: tuple[float, int] | None, seconds: float, rate: float
) -> dict[str, Any]:
    """What the store's disk did during a create: the fraction of its time the disk was
    busy (below 1, it idled while the create ran: a stall upstream of it), and how fast it
    wrote while busy against the write baseline's rate (below 1, the create's writes
    reached the disk in a slower pattern). Absent where the store has no block device."""
    if before is None or after is None:
        return {}
    busy, written = after[0] - before[0], after[1] - before[1]
    return {
        "disk_busy": busy / seconds,
        "disk_written_mb": written / 1e6,
        "busy_rate_over_write": written / busy / rate if busy > 0 else None,
    }


def _layers(store: Path) -> list[dict[str, Any]]:
    [manifest] = [p for p in (store / "manifests").rglob("*") if p.is_file()]
    return json.loads(manifest.read_text())["layers"]


COLUMNS = [
    ("path", "create"),
    ("source_mb", "source MB"),
    ("ftw_mb", "FTW MB"),
    ("store_mb", "store MB"),
    ("store_over_ftw", "store/FTW"),
    ("seconds", "create s"),
    ("read_s", "read s"),
    ("write_s", "write s"),
    ("ratio", "/(read+write)"),
    ("disk_busy", "disk busy"),
    ("disk_written_mb", "disk MB written"),
    ("busy_rate_over_write", "busy GB/s / write's"),
]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="freetoken bench create", description=__doc__)
    ap.formatter_class = argparse.RawDescriptionHelpFormatter
    ap.add_argument("--mib", type=int, default=400, help="the checkpoint's size (about)")
    ap.add_argument("--work", default="", help="where the checkpoint and the store are kept")
    ap.add_argument("--repeats", type=int, default=3, help="creates of each path")
    ap.add_argument("--upload", action="store_true", help="also time the upload path")
    ap.add_argument("--cold", action="store_true", help="also without a converter started ahead")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    head = common.header("create")
    work = Path(args.work or Path.cwd() / ".freetoken-bench")
    work.mkdir(parents=True, exist_ok=True)
    source = checkpoint(work, args.mib)
    store = work / "create-store"
    store.mkdir(exist_ok=True)
    start = converter_start()
    rows = []
    for warm in (True, False) if args.cold else (True,):
        env = [f"FREETOKEN_WARM_START={int(warm)}"]
        with served.server(store, env, work / "create-server.log") as url:
            for _ in range(args.repeats):
                for in_place in (True, False) if args.upload else (True,):
                    row = one_create(url, store, source, in_place)
                    # what is left once the converter's start-up is not paid
                    paid = 0.0 if warm else start
                    work_ratio = (row["seconds"] - paid) / (row["read_s"] + row["write_s"])
                    rows.append(
                        {**row, "converter": "spare" if warm else "cold", "start_s": start}
                        | {"work_ratio": work_ratio}
                    )
    extra = [("converter", "converter"), ("start_s", "start-up s")]
    extra += [("work_ratio", "(create-start-up paid)/(read+write)")]
    common.emit(rows, [*COLUMNS, *extra], args.json, head)


if __name__ == "__main__":
    main()
