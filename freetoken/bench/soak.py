"""`freetoken bench soak`: a bounded load and fault harness, on loopback only.

    freetoken bench soak load   --clients 32 --seconds 60    streaming clients, all four APIs
    freetoken bench soak faults                             runner and server kills
    freetoken bench soak fuzz   --requests 5000              generated requests, every endpoint

Each run starts its own server (`freetoken serve` on a free loopback port) over a store in
`--work` holding the demo model (a small random-weight Qwen3-MoE, freetoken/tools/demo.py),
and prints what it counted: requests, failures by kind, and anything lost (a stream that
ended with neither its last event nor an error). Nothing leaves the machine: the server,
the registry the fault runs pull from and the throttle in front of it all listen on
127.0.0.1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from freetoken import config
from freetoken.bench import common
from freetoken.bench.served import free_port, wait_ready
from freetoken.store import CreateSpec, Store

__all__ = ["Server", "main", "prepare_store"]

MODEL = "demo"  # the model every run serves (freetoken.bench.fuzz names it too)


def demo_weights(work: Path) -> Path:
    """The demo model's Hugging Face directory, written once into `work`."""
    from freetoken.tools import demo

    demo.write_demo(work / "demo")
    return work / "demo" / "weights"


def prepare_store(work: Path) -> Store:
    """The store of every run: the demo model with its Modelfile's settings."""
    from freetoken.tools import demo

    store = Store(work / "store")
    with contextlib.suppress(Exception):
        store.resolve(MODEL)
        return store
    spec = CreateSpec(
        name=MODEL, from_=str(demo_weights(work)), system=demo.SYSTEM, parameters=demo.PARAMETERS
    )
    for _ in store.plan_create(spec).run():
        pass
    return store


class Server:
    """`freetoken serve` as a child process on a loopback port, which a run may kill."""

    def __init__(self, store: Path, log: Path, env: dict[str, str] | None = None):
        self.store, self.log = store, log
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = env or {}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Server:
        settings = {
            "FREETOKEN_HOST": f"127.0.0.1:{self.port}",
            "FREETOKEN_MODELS": str(self.store),
            **self.env,
        }
        cmd = [sys.executable, "-m", "freetoken", "serve"]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                cmd, env=config.child_environment(settings), stdout=out, stderr=subprocess.STDOUT
            )
        wait_ready(self.proc, self.url + "/api/version", "the server", self.log, 60)
        return self

    def runners(self) -> list[int]:
        """Process ids of the server's runners (its children running the runner module)."""
        assert self.proc is not None
        out = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = stat.read_text().rsplit(")", 1)[1].split()
                cmdline = (stat.parent / "cmdline").read_bytes()
                if int(fields[1]) == self.proc.pid and b"freetoken.runtime.runner" in cmdline:
                    out.append(int(stat.parent.name))
        return out

    def rss_mib(self) -> float:
        """Resident memory of the server and its runners together, in MiB."""
        assert self.proc is not None
        kib = 0
        for pid in (self.proc.pid, *self.runners()):
            with contextlib.suppress(OSError, ValueError):
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        kib += int(line.split()[1])
        return round(kib / 1024, 1)

    def kill(self) -> None:
        """SIGKILL: no clean-up runs (its runners exit once they see it gone)."""
        assert self.proc is not None
        runners = self.runners()
        self.proc.kill()
        self.proc.wait()
        for pid in runners:  # as their parent-watch would, a second later
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


@contextlib.contextmanager
def serving(work: Path, env: dict[str, str] | None = None) -> Iterator[Server]:
    server = Server(work / "store", work / "server.log", env).start()
    try:
        yield server
    finally:
        server.stop()


def reference_chat(url: str) -> str:
    """A chat whose answer is a function of the model alone (greedy, seeded)."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say something."}],
        "stream": False,
        "options": {"temperature": 0, "seed": 7, "num_predict": 16},
    }
    r = httpx.post(url + "/api/chat", json=body, timeout=300)
    r.raise_for_status()
    return r.json()["message"]["content"]


def report(kind: str, figures: dict[str, Any], as_json: bool) -> None:
    head = common.header(f"soak {kind}") | {"model": MODEL}
    if as_json:
        print(json.dumps(head | figures))
        return
    print(f"# {head['bench']}  commit {head['commit']}  {head['date']}  cpu {head['cpu']}")
    width = max(len(k) for k in figures)
    for key, value in figures.items():
        print(f"{key:<{width}}  {value}")


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="freetoken bench soak", description=__doc__.split("\n")[0])
    p.add_argument("mode", choices=("load", "faults", "fuzz"))
    p.add_argument("--work", default="", help="where the store and logs are kept")
    p.add_argument("--clients", type=int, default=32, help="load: streaming clients")
    p.add_argument("--seconds", type=float, default=60, help="load: how long they run")
    p.add_argument("--disconnects", type=float, default=0.05, help="load: share cut short")
    p.add_argument("--poison-every", type=float, default=5, help="load: seconds between poisons")
    p.add_argument("--num-predict", type=int, default=24, help="load: tokens per answer")
    p.add_argument("--requests", type=int, default=5000, help="fuzz: requests to send")
    p.add_argument("--concurrency", type=int, default=8, help="fuzz: requests in flight")
    p.add_argument("--case-seconds", type=float, default=60, help="fuzz: a case's longest")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--env", action="append", default=[], help="NAME=VALUE for the server")
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _arguments(argv)
    work = Path(args.work or Path.cwd() / ".freetoken-bench" / "soak").resolve()
    work.mkdir(parents=True, exist_ok=True)
    prepare_store(work)
    env = dict(e.split("=", 1) for e in args.env)
    if args.mode == "load":
        from freetoken.bench import soak_load

        figures = soak_load.run(args, work, env)
    elif args.mode == "faults":
        from freetoken.bench import soak_faults

        figures = soak_faults.run(work, env)
    else:
        from freetoken.bench import soak_fuzz

        figures = soak_fuzz.run(args, work, env)
    report(args.mode, figures, args.json)
