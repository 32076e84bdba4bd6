"""`freetoken bench gpus`: decode and prefill with the experts spread over several GPUs.

The synthetic model is written once as FTW; every configuration then loads it the way a
runner does (`runtime.loader`, and `freetoken.dist` for several GPUs): one GPU with a
budget of B GiB, one GPU with N·B GiB, and N GPUs with B GiB each, experts spread over
them. Per configuration: bs=1 decode tok/s with uniform and trace routing, prefill tok/s,
and the bound T_dense + m·S / (ΣB_P + B_H), where ΣB_P is measured with every GPU's link
copying at once and m counts the misses of every rank.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import threading
import time
from pathlib import Path

import torch

from freetoken import dist
from freetoken.bench import bw, common, routing, synthmodel
from freetoken.bench.prefill import prefill_seconds
from freetoken.bench.stepper import Bench
from freetoken.ftw import INDEX
from freetoken.ftw.writer import Writer
from freetoken.models.hub import num_experts
from freetoken.moe import profile
from freetoken.runtime import loader

GIB = 2**30


def write_model(name: str, out: Path, device: torch.device) -> Path:
    """The synthetic model as an FTW directory (reused when it is already there)."""
    if (out / INDEX).exists():
        return out
    sm = synthmodel.build(name, device)
    out.parent.mkdir(parents=True, exist_ok=True)
    cfg = out.parent / f"{out.name}-config.json"
    cfg.write_text(json.dumps(sm.config))
    w = Writer(out)
    try:
        for pname, p in sm.model.named_parameters():
            w.add_dense(pname, p.detach().cpu())
        for (layer, bank), t in sorted(sm.banks.items()):
            w.add_bank(layer, bank, t)
        return w.close({"model_type": sm.config["model_type"]}, {"config.json": cfg})
    except BaseException:
        w.abort()
        raise


def pick_dir(requested: Path | None, need: int) -> Path:
    """Memory-backed /dev/shm when it has room (loads then run at memory speed, so the
    comparison is not about the disk), else the cache directory."""
    if requested is not None:
        return requested
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > need * 1.2:
        return shm / "freetoken-bench-gpus"
    from freetoken import config

    return config.current().cache_dir / "bench" / "gpus"


def summed_pcie(devices: list[str], seconds: float) -> tuple[list[float], float]:
    """Each GPU's B_P alone, and the sum with every link copying at once."""
    banks = bw.Banks(2, pin=True)
    alone = [bw.measure_pcie(banks, seconds, device=d) for d in devices]
    out = [0.0] * len(devices)

    def one(i: int) -> None:
        out[i] = bw.measure_pcie(banks, seconds, device=devices[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(devices))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return alone, sum(out)


class Config:
    """One configuration, loaded through the runner's own path; `close` frees everything."""

    def __init__(
        self,
        files: dict[str, Path],
        devices: list[str],
        budget_gib: float,
        policy: str,
        ctx_tokens: int,
        cache_dir: Path,
    ):
        self.devices, self.budget_gib = devices, budget_gib
        self.name = f"{len(devices)} x {budget_gib:g} GiB"
        placement = loader.Placement(policy, int(budget_gib * GIB), cache_dir, 0)
        self.group = dist.launch(devices, files, placement) if len(devices) > 1 else None
        t0 = time.perf_counter()
        try:
            device = dist.use(devices[0]).type  # "cuda" now means rank 0's GPU
            loaded = loader.load(
                files, device, "auto", experts=self.group.experts if self.group else None
            )
            sm = synthmodel.SynthModel(
                loaded.model, loaded.config, {}, loaded.device, loaded.dtype, 0.0
            )
            self.bench = Bench.around(sm, ctx_tokens)
            self.bench.backend = loader.place_experts(loaded, placement, self.group)
        except BaseException:
            if self.group is not None:
                self.group.abort("the benchmark's load failed")
            raise
        self.load_s = time.perf_counter() - t0
        self.expert_bytes = self.bench.backend.expert_bytes

    def misses(self) -> int:
        """Experts not in a GPU cache so far, every rank's (followers report when the group
        goes idle): fetched or run on the CPU, whichever the policy chose."""
        b = self.bench.backend
        b.idle()
        s = b.stats()
        return sum(r["m"] for r in s.get("ranks", [s]))

    def slots(self) -> int:
        cache = self.bench.backend.stats().get("cache")
        return cache["slots"] if cache else 0

    def close(self) -> None:
        if self.bench.graphs is not None:
            self.bench.graphs.reset()
        self.bench.backend.close()
        self.bench = None
        gc.collect()
        torch.cuda.empty_cache()


def decode_rows(
    cfg: Config, mode: str, args, t_dense: float | None, b_sum: float, b_h: float
) -> dict:
    bench, c = cfg.bench, cfg.bench.sm.config
    kw = {} if mode == "trace" else {"reuse": 0.0, "zipf": 0.0}
    tr = routing.Trace(c["num_hidden_layers"], num_experts(c), c["num_experts_per_tok"], **kw)
    bench.routes = routing.install_trace(
        bench.sm.model, tr, c["num_hidden_layers"], bench.sm.device
    )
    if bench.graphs is not None:
        bench.graphs.reset()  # captured steps read the previous route table
    bench.decode(mode, args.settle, 4, 100)  # settle the caches (and adaptive's choices)
    runs = []
    for r in range(args.repeats):
        before: list[int] = []
        t, _ = bench.decode(
            mode, args.tokens, args.warmup, r, at_start=lambda b=before: b.append(cfg.misses())
        )
        runs.append((t, (cfg.misses() - before[0]) / args.tokens))
    t, miss = sorted(runs)[len(runs) // 2]
    row = {"routing": mode, "tok_s": 1 / t, "misses_per_token": miss}
    if t_dense is not None:
        bound = t_dense + miss * cfg.expert_bytes / ((b_sum + b_h) * 1e9)
        row.update(bound_tok_s=1 / bound, ratio_to_bound=bound / t)
    return row


def run_config(
    cfg: Config, args, t_dense: dict, b_sum: float, b_h: float, head: dict
) -> list[dict]:
    base = {
        "config": cfg.name,
        "gpus": len(cfg.devices),
        "budget_gib": cfg.budget_gib,
        "slots": cfg.slots(),
        "load_s": cfg.load_s,
        "b_p_sum_gbps": b_sum,
    }
    rows = []
    for mode in args.routing.split(","):
        row = {**base, **decode_rows(cfg, mode, args, t_dense.get(mode), b_sum, b_h)}
        print(json.dumps({**head, **row}), flush=True)
        rows.append(row)
    if args.profile:
        from freetoken.bench.stepper import profile_steps

        profile_steps(cfg.bench, args.routing.split(",")[-1], cfg.name)
    cfg.bench.routes = None
    routing.uninstall(cfg.bench.sm.model)  # prefill routes by the model's own routers
    if cfg.bench.graphs is not None:
        cfg.bench.graphs.reset()  # captured steps read the route table just dropped
    for n in (int(x) for x in args.prefill.split(",") if x):
        prefill_seconds(cfg.bench, min(n, 512), args.chunk, 0)
        t = statistics.median(prefill_seconds(cfg.bench, n, args.chunk, s) for s in range(2))
        row = {**base, "routing": f"prefill {n}", "tok_s": n / t, "ttft_s": t}
        print(json.dumps({**head, **row}), flush=True)
        rows.append(row)
    return rows


def parse(argv: list[str] | None):
    ap = argparse.ArgumentParser(prog="freetoken bench gpus", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(synthmodel.SHAPES))
    ap.add_argument(
        "--gpus", type=int, default=0, help="GPUs to spread over (default: every visible one)"
    )
    ap.add_argument("--budget", type=float, default=24.0, help="VRAM budget per GPU in GiB")
    ap.add_argument("--policy", default="adaptive")
    ap.add_argument("--routing", default="uniform,trace")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--warmup", type=int, default=16)
    ap.add_argument("--settle", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--prefill", default="2048,8192", help="prompt lengths ('' for none)")
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--bw-seconds", type=float, default=2.0)
    ap.add_argument(
        "--configs",
        default="1xB,1xNB,NxB",
        help="which of: one GPU at B GiB, one at N·B GiB, N GPUs at B GiB each",
    )
    ap.add_argument(
        "--profile", action="store_true", help="a torch profile of decode steps of each config"
    )
    ap.add_argument("--dir", type=Path, default=None, help="where the model's FTW is written")
    ap.add_argument("--keep", action="store_true", help="keep the FTW for the next run")
    ap.add_argument(
        "--cpu-ranks",
        type=int,
        default=0,
        help="CPU ranks on gloo instead of GPUs (a check of the plumbing, not a benchmark)",
    )
    ap.add_argument("--json", action="store_true")
    return ap.parse_args(argv)


def bandwidths(
    devices: list[str], seconds: float, cache_dir: Path, head: dict
) -> tuple[list[float], float, float]:
    """(each GPU's B_P alone, ΣB_P with every link at once, B_H) in GB/s; saved as this
    machine's profile, which every runner's split starts from."""
    if devices[0] == "cpu":  # the plumbing only: whatever profile this machine has, or the defaults
        return [0.0], 0.0, profile.bandwidths(cache_dir)[1] / 1e9
    b = bw.run(seconds, 4.0)
    profile.save(cache_dir, {**b, "date": head["date"]})
    alone, b_sum = summed_pcie(devices, seconds)
    return alone, b_sum, b["cpu_expert_gbps"]


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    from freetoken import config

    n = args.cpu_ranks or args.gpus or torch.cuda.device_count()
    if n < 2:
        raise SystemExit("bench gpus needs at least 2 CUDA devices")
    cache_dir = config.current().cache_dir
    head = common.header("gpus")
    devices = ["cpu"] * n if args.cpu_ranks else [f"cuda:{i}" for i in range(n)]
    alone, b_sum, b_h = bandwidths(devices, args.bw_seconds, cache_dir, head)
    print(
        f"B_P per GPU {', '.join(f'{x:.1f}' for x in alone)} GB/s alone, {b_sum:.1f} together; "
        f"B_H {b_h:.1f}"
    )
    shape = synthmodel.SHAPES[args.model]
    expert_bytes = 3 * shape["hidden_size"] * shape["moe_intermediate_size"] * 2
    out = (
        pick_dir(args.dir, shape["num_hidden_layers"] * shape["num_experts"] * expert_bytes)
        / args.model
    )
    t0 = time.perf_counter()
    files = {p.name: p for p in write_model(args.model, out, torch.device(devices[0])).iterdir()}
    print(f"model written to {out} in {time.perf_counter() - t0:.1f} s", flush=True)
    try:
        rows = run_plans(files, devices, args, cache_dir, (alone[0], b_sum, b_h), head)
    finally:
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
    common.emit(
        rows,
        [
            ("config", "config"),
            ("routing", "routing"),
            ("slots", "slots"),
            ("tok_s", "tok/s"),
            ("misses_per_token", "miss/tok"),
            ("bound_tok_s", "bound"),
            ("ratio_to_bound", "/bound"),
            ("load_s", "load s"),
        ],
        False,
        head,
    )


def run_plans(
    files: dict[str, Path],
    devices: list[str],
    args,
    cache_dir: Path,
    bws: tuple[float, float, float],
    head: dict,
) -> list[dict]:
    """Every expert resident first (T_dense for the bounds), then each configuration asked for."""
    b_one, b_sum, b_h = bws
    ctx = (
        max([int(x) for x in args.prefill.split(",") if x] + [0])
        + args.settle
        + args.tokens
        + args.warmup
        + 64
    )
    plans = {
        "resident": ([devices[0]], None),
        "1xB": ([devices[0]], args.budget),
        "1xNB": ([devices[0]], len(devices) * args.budget),
        "NxB": (devices, args.budget),
    }
    rows, t_dense = [], {}
    for name in ["resident", *args.configs.split(",")]:
        devs, budget = plans[name]
        cfg = Config(
            files,
            devs,
            budget or 0.0,
            "resident" if budget is None else args.policy,
            ctx,
            cache_dir,
        )
        try:
            if budget is None:
                for mode in args.routing.split(","):
                    t_dense[mode] = 1 / decode_rows(cfg, mode, args, None, 0, 0)["tok_s"]
                print(
                    "resident: T_dense "
                    + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in t_dense.items())
                )
            else:
                rows += run_config(
                    cfg, args, t_dense, b_one if len(devs) == 1 else b_sum, b_h, head
                )
        finally:
            cfg.close()
    return rows


if __name__ == "__main__":
    main()
