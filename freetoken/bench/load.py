"""`freetoken bench load`: FTW load speed against a raw O_DIRECT read of the same files
(taken before and after each load), pin-after-fill against pin-before-fill, huge pages
against 4 KiB pages, and parallel against serial reading.

The synthetic model has Qwen3-30B-A3B-shaped expert banks (128 experts, hidden 2048,
expert FFN 768, bf16), as many layers as --gib asks for; it is written once per machine.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from freetoken.bench import common
from freetoken.ftw import ALIGN, hostmem, reader
from freetoken.ftw.hostmem import HostBuffer
from freetoken.ftw.writer import Writer

E, H, I = 128, 2048, 768  # Qwen3-30B-A3B expert shape
LAYER_BYTES = E * (2 * I * H + H * I) * 2


def write_synthetic(out: Path, gib: float) -> Path:
    layers = max(1, round(gib * 2**30 / LAYER_BYTES))
    if (out / "ftw.json").exists() and json.loads((out / "ftw.json").read_text()).get(
        "layers"
    ) == layers:
        return out
    g = torch.Generator().manual_seed(0)
    # one random block, tiled: content does not matter for I/O, but it must not be zeros
    block = torch.randint(-30000, 30000, (E, 2 * I, H), generator=g, dtype=torch.int16).view(
        torch.bfloat16
    )
    down = block.reshape(-1)[: E * H * I].reshape(E, H, I)
    (out.parent).mkdir(parents=True, exist_ok=True)
    cfg = out.parent / "bench-config.json"
    cfg.write_text("{}")
    w = Writer(out)
    for layer in range(layers):
        w.add_bank(layer, "gate_up", block)
        w.add_bank(layer, "down", down)
    w.close({"model_type": "bench", "layers": layers}, {"config.json": cfg})
    return out


def raw_read(files: list[Path], workers: int) -> float:
    """GB/s of O_DIRECT reads of whole files into reused aligned buffers (no page faults)."""
    total = sum(f.stat().st_size for f in files)
    chunks = [(f, off) for f in files for off in range(0, f.stat().st_size, reader.CHUNK)]
    bufs = [HostBuffer(reader.CHUNK) for _ in range(workers)]
    for b in bufs:
        b.view[::ALIGN] = bytes(len(b.view[::ALIGN]))  # fault the pages in once, outside the timing
    fds = {f: os.open(f, os.O_RDONLY | os.O_DIRECT) for f in files}

    def job(i: int) -> None:
        buf = bufs[i % workers].view
        for f, off in chunks[i::workers]:
            n = min(reader.CHUNK, f.stat().st_size - off)
            os.preadv(fds[f], [buf[:n]], off)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(workers) as ex:
        list(ex.map(job, range(workers)))
    dt = time.perf_counter() - t0
    for fd in fds.values():
        os.close(fd)
    return total / dt / 1e9


def load_once(files: dict[str, Path], **kw) -> reader.LoadStats:
    stats = reader.LoadStats()
    w = reader.read(files, stats=stats, **kw)
    del w
    gc.collect()
    return stats


def configs(pin: bool, workers: int, repeats: int) -> list[tuple[str, dict]]:
    """The loads to time, in order; the served configuration `repeats` times, spread out."""
    huge = hostmem.huge_pages_pay()
    par = dict(mode="parallel", workers=workers, pin=pin)
    fill = "pin after fill" if pin else "no pin (no GPU)"
    served = (f"as served: parallel, {fill}, {'huge' if huge else '4 KiB'} pages (measured)", par)
    others = [
        (f"parallel, {fill}, 4 KiB pages", dict(par, huge_pages=False)),
        (f"parallel, {fill}, huge pages", dict(par, huge_pages=True)),
        (f"serial, {fill}", dict(par, mode="serial")),
    ]
    if pin:
        others += [
            (
                "parallel, pin before fill, 4 KiB pages",
                dict(par, pin_before_fill=True, huge_pages=False),
            ),
            ("parallel, no pin, 4 KiB pages", dict(par, pin=False, huge_pages=False)),
        ]
    total = len(others) + repeats
    at = {
        round(i * (total - 1) / max(repeats - 1, 1)) for i in range(repeats)
    }  # evenly, first and last
    rest = iter(others)
    return [served if i in at else next(rest) for i in range(total)]


def timed_loads(
    files: dict[str, Path], shards: list[Path], plan: list[tuple[str, dict]], workers: int
) -> list[dict]:
    """Each load between two raw reads of the same files: the disk's own speed drifts by a
    quarter within minutes on a virtual disk, so a load is compared with the raw reads
    around it, not with one taken minutes away."""
    raws = [raw_read(shards, workers)]
    rows = []
    for name, kw in plan:
        s = load_once(files, **kw)
        raws.append(raw_read(shards, workers))
        raw = (raws[-2] + raws[-1]) / 2
        rows.append(
            {
                "config": name,
                "gb": s.bytes / 1e9,
                "seconds": s.seconds,
                "gbps": s.gbps,
                "pin_s": s.pin_seconds,
                "read_s": s.read_seconds,
                "direct": s.direct,
                "raw_gbps": raw,
                "ratio_to_raw": s.gbps / raw,
            }
        )
    return rows


def merge(rows: list[dict]) -> list[dict]:
    """One row per configuration: the repeat with the median ratio, and the spread of ratios."""
    out = []
    for name in dict.fromkeys(r["config"] for r in rows):
        runs = sorted((r for r in rows if r["config"] == name), key=lambda r: r["ratio_to_raw"])
        row = dict(runs[len(runs) // 2], repeats=len(runs))
        if len(runs) > 1:
            row["ratio_min"], row["ratio_max"] = runs[0]["ratio_to_raw"], runs[-1]["ratio_to_raw"]
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="freetoken bench load", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=None, help="where the synthetic FTW lives")
    ap.add_argument("--gib", type=float, default=16.0)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3, help="loads of the served configuration")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    from freetoken import config

    out = args.dir or (config.current().cache_dir / "bench" / "ftw-load")
    t0 = time.perf_counter()
    write_synthetic(out, args.gib)
    print(f"synthetic FTW ready in {time.perf_counter() - t0:.1f} s at {out}")
    files = {p.name: p for p in out.iterdir()}
    shards = sorted(p for n, p in files.items() if n.startswith("ftw-"))
    pin = torch.cuda.is_available()
    one = raw_read(shards, 1)
    rows = merge(timed_loads(files, shards, configs(pin, args.workers, args.repeats), args.workers))
    raws = [r["raw_gbps"] for r in rows]
    print(
        f"raw O_DIRECT read: {min(raws):.2f}–{max(raws):.2f} GB/s with {args.workers} readers "
        f"over the run, {one:.2f} with one"
    )
    rows.append({"config": "raw O_DIRECT read, one reader", "gb": rows[0]["gb"], "gbps": one})
    by = {r["config"]: r for r in rows}
    if pin:
        after, before = (
            by["parallel, pin after fill, 4 KiB pages"],
            by["parallel, pin before fill, 4 KiB pages"],
        )
        saved = before["seconds"] - after["seconds"]
        print(
            f"pin-after-fill saves {saved:.2f} s of {before['seconds']:.2f} s "
            f"({saved / max(before['pin_s'], 1e-9):.0%} of the pin-before-fill registration cost)"
        )
    common.emit(
        rows,
        [
            ("config", "config"),
            ("gb", "GB"),
            ("seconds", "s"),
            ("gbps", "GB/s"),
            ("raw_gbps", "raw GB/s"),
            ("ratio_to_raw", "/raw"),
            ("ratio_min", "min"),
            ("ratio_max", "max"),
            ("read_s", "read s"),
            ("pin_s", "pin s"),
        ],
        args.json,
        common.header("load"),
    )


if __name__ == "__main__":
    main()
