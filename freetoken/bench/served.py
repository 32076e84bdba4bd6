"""What the benchmarks that go through the HTTP server share: a server of their own (or one
already running), and a model in its store made from a directory or from a named shape.

A shape (models/shapes.py) becomes a Hugging Face checkpoint with seeded random weights,
written once into a work directory and created into the store as a user's `freetoken
create` would, so the measured path is the whole product's: FTW conversion, the runner's
load, the scheduler, the API.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from freetoken import config
from freetoken.models.shapes import SHAPES
from freetoken.server.runner import ADAPTIVE_MARK
from freetoken.store import CreateSpec, Store

__all__ = [
    "add_arguments",
    "checkpoint",
    "ensure_model",
    "expert_formats",
    "forget_placements",
    "free_port",
    "measure_bandwidths",
    "print_decisions",
    "runner_config",
    "server",
    "server_settings",
    "wait_ready",
]


def add_arguments(p: Any) -> None:
    """The options every served benchmark takes."""
    p.add_argument("--url", default="", help="a running server to use (default: start one)")
    p.add_argument("--model", default="", help="a model in the store (with --url, or --store)")
    p.add_argument("--from", dest="source", default="", help="a Hugging Face directory to create")
    p.add_argument("--shape", default="", help=f"a synthetic checkpoint: {', '.join(SHAPES)}")
    p.add_argument("--layers", type=int, default=0, help="the shape cut to this many layers")
    p.add_argument("--dtype", default="bfloat16", help="the synthetic checkpoint's dtype")
    p.add_argument(
        "--quantize",
        default="",
        help="the synthetic model's experts packed as `create --quantize` would (q4_K_M, "
        "q8_0, or a block format): written straight to FTW, at the quantized size",
    )
    p.add_argument(
        "--embed-std",
        type=float,
        default=0.0,
        help="the synthetic token embedding's scale (1: routing follows the sampled tokens, "
        "so the uniform regime routes near-uniformly; default: it follows the context, hot)",
    )
    p.add_argument("--work", default="", help="where checkpoints and the store are kept")
    p.add_argument(
        "--env", action="append", default=[], help="NAME=VALUE for a server started here"
    )
    p.add_argument(
        "--forget-placements",
        action="store_true",
        help="before a server of its own starts, drop what adaptive learned on this machine, "
        "so the model loads as on a first run (else stages in turn start from each other's)",
    )


def checkpoint(
    shape: str,
    layers: int,
    work: Path,
    dtype: str = "bfloat16",
    embed_std: float = 0.0,
    quantize: str = "",
) -> Path:
    """A random-weight checkpoint of `shape` (cut to `layers`), written once into `work`;
    with `quantize`, an FTW directory with the experts packed (bench/synthftw.py)."""
    from freetoken.bench import synthftw
    from freetoken.tools import synth

    cfg = dict(SHAPES[shape])
    if layers:
        cfg["num_hidden_layers"] = layers
    name = f"{shape}-{cfg['num_hidden_layers']}l-{quantize or dtype}" + (
        f"-e{embed_std:g}" if embed_std else ""
    )
    out = work / "checkpoints" / name
    if (out / "config.json").exists():
        return out
    partial = out.with_name(name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        if quantize:
            synthftw.write(partial, cfg, quantize, dtype, embed_std)
        else:
            synth.write_checkpoint(partial, cfg, dtype, embed_std)
    except ValueError as e:
        raise SystemExit(f"{e}: pass --from DIR") from None
    partial.rename(out)
    return out


def ensure_model(store: Store, name: str, source: Path) -> None:
    """Creates `name` from `source` unless the store has it."""
    with contextlib.suppress(Exception):
        store.resolve(name)
        return
    t0 = time.perf_counter()
    for _ in store.plan_create(CreateSpec(name=name, from_=str(source))).run():
        pass
    print(f"# created {name} from {source} in {time.perf_counter() - t0:.0f} s", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, probe: str, what: str, log: Path, seconds: float) -> None:
    """Returns once `probe` answers 200; exits naming `what` and its log if the child
    process ends first or `seconds` pass."""
    deadline = time.monotonic() + seconds
    while True:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(probe, timeout=2).status_code == 200:
                return
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{what} did not start (see {log})")
        time.sleep(0.2)


@contextlib.contextmanager
def server(store_dir: Path, env: list[str], log: Path) -> Iterator[str]:
    """`freetoken serve` on a free loopback port over `store_dir`; yields its URL."""
    port = free_port()
    settings = {"FREETOKEN_HOST": f"127.0.0.1:{port}", "FREETOKEN_MODELS": str(store_dir)}
    environ = config.child_environment(settings | _overrides(env))
    cmd = [sys.executable, "-m", "freetoken", "serve"]
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, env=environ, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url + "/api/version", "the server", log, 60)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def server_settings(env: list[str]) -> dict[str, str]:
    """The FreeToken settings a server of `server` given `env` starts with (this process's
    environment, then `env`), but where it listens and its store: what a row was measured
    under, for the record."""
    environ = config.child_environment(_overrides(env))
    own = {"FREETOKEN_HOST", "FREETOKEN_MODELS"}
    return {k: v for k, v in environ.items() if k.startswith("FREETOKEN_") and k not in own}


def runner_config(env: list[str]) -> Any:
    """The settings a runner started by a server given `env` (NAME=value) would read."""
    return config.load(config.child_environment(_overrides(env)))


def _overrides(env: list[str]) -> dict[str, str]:
    """--env's NAME=value settings, by name."""
    return dict(e.split("=", 1) for e in env)


def measure_bandwidths(
    env: list[str], formats: list[str] | None = None, seconds: float = 1.0, gib: float = 4.0
) -> bool:
    """Measures B_P and B_H as `freetoken bench bw` does, into the profile the server's
    runners read, where the machine has a GPU and only a load's probe measured them: the
    rows' bound uses the runner's figures, and a probe's low ones read as a speed near or
    over the bound. B_H of the block formats `formats` (every one with None), or of those
    among them a profile from `bench bw` lacks: each takes seconds to pack and time, and a
    fresh machine's first run paid for all eight. True where it measured."""
    import torch

    if not torch.cuda.is_available():
        return False
    from freetoken import quant
    from freetoken.bench import bw, common
    from freetoken.moe import profile

    cache_dir = runner_config(env).cache_dir
    formats = list(quant.FORMATS) if formats is None else formats
    known = profile.load(cache_dir) if profile.from_bench(cache_dir) else None
    if known is None:
        print("# measuring B_P and B_H for the bound (as `freetoken bench bw` does)", flush=True)
        measured = bw.run(seconds, gib, formats)
    else:
        missing = [f for f in formats if f"cpu_expert_gbps_{f}" not in known]
        if not missing:
            return False
        print(f"# measuring B_H of {', '.join(missing)} for the bound", flush=True)
        per = bw.measure_formats(missing, seconds, gib, float(known["cpu_expert_gbps"]))
        measured = bw.with_formats(known, per)
    profile.save(cache_dir, {**measured, "date": common.header("bw")["date"]})
    return True


def forget_placements(env: list[str]) -> None:
    """Drops what adaptive learned on this machine, where the server's runners keep it."""
    from freetoken.moe import learned

    if learned.forget(runner_config(env).cache_dir):
        print("# dropped the placements adaptive learned on this machine", flush=True)


def expert_formats(store: Store, name: str) -> list[str] | None:
    """The block formats of `name`'s expert banks ([] where they are float), or None where
    its weights are not an FTW index this can read."""
    from freetoken.ftw import FtwError
    from freetoken.ftw.reader import Index

    files = {k: Path(v) for k, v in store.runner_files(store.resolve(name)).items()}
    try:
        tensors = Index.load(files).tensors
    except FtwError:
        return None
    return sorted({t["quant"] for t in tensors if t.get("kind") == "bank" and t.get("quant")})


@contextlib.contextmanager
def target(args: Any) -> Iterator[tuple[str, str, Store]]:
    """(server URL, model name, its store) for the options of `add_arguments`."""
    work = Path(args.work or Path.cwd() / ".freetoken-bench")
    work.mkdir(parents=True, exist_ok=True)
    if args.url:
        yield args.url, args.model, Store.from_config(config.current())
        return
    store = Store(work / "store")
    if args.shape:
        source = checkpoint(
            args.shape, args.layers, work, args.dtype, args.embed_std, args.quantize
        )
        name = args.model or source.name.lower()
    elif args.source:
        source, name = Path(args.source), args.model or Path(args.source).name.lower()
    else:
        raise SystemExit("name a model: --url and --model, --shape, or --from")
    ensure_model(store, name, source)
    measure_bandwidths(args.env, expert_formats(store, name))
    if args.forget_placements:
        forget_placements(args.env)
    log = work / "server.log"
    start = log.stat().st_size if log.exists() else 0  # the log is appended to
    with server(work / "store", args.env, log) as url:
        yield url, name, store
    print_decisions(log, start)


def print_decisions(log: Path, start: int = 0) -> None:
    """The runner's adaptive decisions in the server's log from byte `start` on (the
    locality check, the miss gate's verdicts, each measurement and trial), as comments: a
    run's output then says why each row ran in its placement."""
    with open(log, "rb") as f:
        f.seek(start)
        text = f.read().decode(errors="replace")
    for line in text.splitlines():
        if (at := line.find(ADAPTIVE_MARK)) >= 0:
            print("#" + line[at:], flush=True)
