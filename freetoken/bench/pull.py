"""`freetoken bench pull`: pull throughput on loopback against a raw copy of the same bytes,
and the time to finish a pull interrupted half way.

A model with one large file is pushed into a registry served on loopback: incompressible
bytes (sent as they are), or with --weights bf16 weight-like bytes (sent zstd-compressed in
frames). It is then pulled into fresh stores:
  raw     the same wire blob fetched with the same number of parallel ranged GETs, written
          to a file, with no hashing or decompression (the floor of the transport); and
          once more with the bytes dropped, for what writing them costs;
  pull    `freetoken pull`'s path: ranged parts, decompression, hashing, verification;
  resume  a pull stopped at 50 % and started again: the share of the wire bytes fetched
          again, the share of the file read back to verify it, and the time against the
          whole pull's.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from freetoken.bench import common
from freetoken.pull import TransferOptions, Transfers, pull_model, push_model
from freetoken.store import Store
from freetoken.store import manifest as mf
from freetoken.tools import synth


class _Stop(Exception):
    pass


def _serve(root: Path) -> tuple[subprocess.Popen, int]:
    """The registry in its own process, as it would be on another machine (no shared GIL)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "freetoken.registry", "serve"]
        + ["--root", str(root), "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/v2/", timeout=1)
            return proc, port
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("the registry did not start")


def _payload(n: int, weights: bool) -> bytes:
    if not weights:
        return os.urandom(n)
    import torch  # bf16 weights: zstd saves ~22 % on them, so they travel compressed

    values = (torch.randn(-(-n // 2)) * 0.02).to(torch.bfloat16)
    return values.view(torch.uint8).numpy().tobytes()[:n]


def _model(store: Store, name: str, nbytes: int, weights: bool = False) -> None:
    """A manifest with a config and one large random file, written straight into the store."""
    cfg = json.dumps(synth.qwen3_moe_config(512)).encode()
    layers = [mf.Layer(mf.FILE, store.blobs.put_stream([cfg])[0], len(cfg), "config.json")]
    with store.blobs.writer() as w:
        left = nbytes
        while left:
            n = min(left, 16 << 20)
            w.write(_payload(n, weights))
            left -= n
        digest, _ = w.commit()
    layers.append(mf.Layer(mf.FILE, digest, w.size, "payload.bin"))
    config = store.blobs.put_stream([b'{"model_format":"bench"}'])[0]
    store.write_manifest(
        store_name(name), mf.Manifest(mf.Layer(mf.CONFIG, config, 24), tuple(layers))
    )


def store_name(name: str):
    from freetoken.store import Name

    return Name.parse(name)


def raw_copy(url: str, size: int, streams: int, out: Path | None) -> float:
    """GB/s of parallel ranged GETs of one blob into a file (or, without `out`, dropped),
    nothing else."""
    part = -(-size // streams)
    if out is not None:
        with open(out, "wb") as f:
            f.truncate(size)
    t0 = time.perf_counter()

    def get(i: int) -> None:
        lo, hi = i * part, min(size, (i + 1) * part) - 1
        with (
            httpx.Client(timeout=None) as c,
            c.stream("GET", url, headers={"Range": f"bytes={lo}-{hi}"}) as r,
            open(out or os.devnull, "r+b" if out else "wb") as f,
        ):
            f.seek(lo)
            for chunk in r.iter_bytes(1 << 20):
                if out is not None:
                    f.write(chunk)

    with ThreadPoolExecutor(streams) as ex:
        list(ex.map(get, range(streams)))
    return size / (time.perf_counter() - t0) / 1e9


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="freetoken bench pull", description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument(
        "--weights",
        action="store_true",
        help="bf16 weight-like bytes (sent zstd-compressed) instead of incompressible ones",
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    head = common.header("pull")
    size = int(args.gib * 2**30)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        server, port = _serve(tmp / "registry")
        try:
            rows = _measure(tmp, port, size, args.streams, args.weights)
        finally:
            server.kill()
    for r in rows:
        if args.json:
            print(json.dumps({**head, **r, "streams": args.streams, "weights": args.weights}))
    common.emit(
        rows,
        [
            ("path", "path"),
            ("gb", "GB"),
            ("seconds", "s"),
            ("gbps", "GB/s"),
            ("ratio_to_raw", "/raw"),
            ("refetched_share", "refetched"),
            ("reread_share", "re-read"),
            ("vs_full_pull_time", "/full time"),
        ],
        False,
        head,
    )


def _measure(tmp: Path, port: int, size: int, streams: int, weights: bool) -> list[dict]:
    name = f"127.0.0.1:{port}/library/bench:latest"
    src = Store(tmp / "src")
    _model(src, name, size, weights)
    push_model(src, name, insecure=True)
    wire = max(
        (x for x in mf.read(next((tmp / "registry" / "manifests").rglob("latest")))[0].layers),
        key=lambda x: x.size,
    )
    hub = Transfers(TransferOptions(streams=streams))
    url = f"http://127.0.0.1:{port}/v2/library/bench/blobs/{wire.digest}"
    raw = raw_copy(url, wire.size, streams, tmp / "raw.bin")
    dropped = raw_copy(url, wire.size, streams, None)
    full = pull_model(Store(tmp / "a"), name, insecure=True, transfers=hub)
    half = Store(tmp / "b")

    def stop_half(event: dict) -> None:
        if (
            event.get("total")
            and event.get("completed", 0) >= event["total"] // 2
            and event["total"] > 1 << 20
        ):
            raise _Stop()

    try:
        pull_model(half, name, insecure=True, progress=stop_half, transfers=hub)
    except _Stop:
        pass
    resumed = pull_model(half, name, insecure=True, transfers=hub)
    gbps = full.fetched_bytes / full.seconds / 1e9
    return [
        {"path": "raw ranged copy", "gb": wire.size / 1e9, "gbps": raw, "ratio_to_raw": 1.0},
        {
            "path": "raw, bytes dropped",
            "gb": wire.size / 1e9,
            "gbps": dropped,
            "ratio_to_raw": dropped / raw,
        },
        {
            "path": "freetoken pull",
            "gb": full.fetched_bytes / 1e9,
            "seconds": full.seconds,
            "gbps": gbps,
            "ratio_to_raw": gbps / raw,
            "reread_share": full.reread_bytes / size,
        },
        {
            "path": "resume after 50%",
            "gb": resumed.fetched_bytes / 1e9,
            "seconds": resumed.seconds,
            "refetched_share": resumed.fetched_bytes / max(full.fetched_bytes, 1),
            "reread_share": resumed.reread_bytes / size,
            "vs_full_pull_time": resumed.seconds / full.seconds,
        },
    ]


if __name__ == "__main__":
    main()
