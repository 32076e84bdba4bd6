"""`freetoken bench soak faults`: kills, and what each leaves behind.

- a runner killed under streams: each stream ends with an error (none hangs), and the
  next request starts a fresh runner and answers;
- the server killed during a pull (from the bundled registry, through a throttle so the
  pull is caught in the middle): the model is not listed, the partial download survives
  the restart, and the next pull fetches only what it lacks;
- the server killed during a create (while it converts) and during a delete: no half
  model is listed, and the demo model still answers.

After each kill the store is checked: every listed model resolves, and every blob its
manifest names is in the store at the manifest's size.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from freetoken.bench.served import free_port
from freetoken.bench.soak import MODEL, Server, demo_weights, reference_chat
from freetoken.bench.soak_fuzz import registry
from freetoken.store import Store

__all__ = ["Throttle", "check_store", "run"]


class Throttle:
    """A loopback TCP proxy that passes what the upstream sends at `rate` bytes a second
    (and counts it), so a pull of a small model takes long enough to be interrupted."""

    def __init__(self, upstream_port: int, rate: float):
        self.upstream, self.rate = upstream_port, rate
        self.port, self.sent = free_port(), 0
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(10)

    async def _serve(self) -> None:
        await asyncio.start_server(self._pipe, "127.0.0.1", self.port)

    async def _copy(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, slow: bool):
        with contextlib.suppress(ConnectionError):
            while chunk := await src.read(16 << 10):
                dst.write(chunk)
                await dst.drain()
                if slow:
                    self.sent += len(chunk)
                    await asyncio.sleep(len(chunk) / self.rate)
        dst.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream)
        await asyncio.gather(
            self._copy(reader, up_writer, False), self._copy(up_reader, writer, True)
        )


def check_store(root: Path) -> dict[str, Any]:
    """Listed models that do not resolve or lack a blob (at its size); manifests on disk
    whose blobs are missing (a half model, even if nothing lists it)."""
    store = Store(root)
    broken = []
    for row in store.list_models():
        view = store.resolve(row["name"])
        for layer in (view.manifest.config, *view.manifest.layers):
            if not store.blobs.has(layer.digest) or store.blobs.size(layer.digest) != layer.size:
                broken.append(row["name"])
    listed = {m["name"] for m in store.list_models()}
    on_disk = sum(1 for p in store.manifests.glob("*/*/*/*") if not p.name.startswith("."))
    return {
        "listed": sorted(listed),
        "broken listed": broken,
        "half on disk": on_disk - len(listed),
    }


def _stream(url: str, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
    with httpx.stream("POST", url + path, json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line:
                yield json.loads(line)


def runner_kill(server: Server) -> dict[str, Any]:
    reference_chat(server.url)  # loaded
    body = {"model": MODEL, "messages": [{"role": "user", "content": "go"}]}
    body["options"] = {"num_predict": 400}
    started = threading.Semaphore(0)

    def stream() -> str:
        for ev in _stream(server.url, "/api/chat", body):
            started.release()
            if "error" in ev:
                return "error"
            if ev.get("done"):
                return "done"
        return "lost"

    with ThreadPoolExecutor(6) as pool:
        streams = [pool.submit(stream) for _ in range(6)]
        for _ in range(6):
            started.acquire(timeout=120)
        killed = server.runners()
        for pid in killed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        ends = [f.result(timeout=120) for f in streams]
    answer = reference_chat(server.url)
    return {
        "runners killed": len(killed),
        "streams": {k: ends.count(k) for k in sorted(set(ends))},
        "next request": "answers" if answer is not None else "fails",
    }


def _push_other(server: Server, reg_port: int, work: Path) -> None:
    """Puts a model into the registry whose blobs the store then lacks (the demo's shape
    with four times the experts, twice the layers and another seed: ~25 MB, several zstd
    frames, so a pull can be cut between them): a pull of it must fetch every byte."""
    from freetoken.tools import demo, synth

    weights = work / "pull-source"
    if not (weights / "config.json").exists():
        shape = {**demo.DEMO_SHAPE, "num_experts": 64, "num_hidden_layers": 8}
        synth.write_qwen3_moe(weights, seed=1, vocab_size=2048, dtype="bfloat16", **shape)
    create = {"model": "soak-src", "from": str(weights)}
    assert list(_stream(server.url, "/api/create", create))[-1].get("status") == "success"
    name = f"127.0.0.1:{reg_port}/soak/other:latest"
    copy = {"source": "soak-src", "destination": name}
    httpx.post(server.url + "/api/copy", json=copy).raise_for_status()
    events = list(_stream(server.url, "/api/push", {"model": name, "insecure": True}))
    assert events[-1].get("status") == "success", events[-1]
    for local in (name, "soak-src"):
        httpx.request("DELETE", server.url + "/api/delete", json={"model": local})


def _partials(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "blobs").glob("*-partial*"))


def _kill_part_way(server: Server, throttle: Throttle, name: str, share: float = 0.4) -> None:
    """Kills the server once `share` of the pull's largest blob has come through (the
    bytes are counted at the throttle: progress lines come in steps too coarse for this)."""
    largest = [0]

    def follow() -> None:
        with contextlib.suppress(httpx.TransportError):
            for ev in _stream(server.url, "/api/pull", {"model": name, "insecure": True}):
                largest[0] = max(largest[0], ev.get("total") or 0)

    threading.Thread(target=follow, daemon=True).start()
    deadline = time.monotonic() + 120
    while not (largest[0] > 1 << 20 and throttle.sent > share * largest[0]):
        assert time.monotonic() < deadline, "the pull did not get going"
        time.sleep(0.05)
    server.kill()


def _wire_size(registry_url: str, repo: str) -> int:
    accept = {"Accept": "application/vnd.docker.distribution.manifest.v2+json"}
    m = httpx.get(f"{registry_url}/v2/{repo}/manifests/latest", headers=accept).json()
    return m["config"]["size"] + sum(layer["size"] for layer in m["layers"])


def pull_kill(work: Path, env: dict[str, str]) -> dict[str, Any]:
    store = work / "store"
    # two streams: parts large enough to be cut between frames, checkpointed as they go
    env = {"FREETOKEN_MAX_TRANSFER_STREAMS": "2", **env}
    with registry(work / "faults-registry", work / "registry.log") as reg:
        reg_port = int(reg.rsplit(":", 1)[1])
        server = Server(store, work / "server.log", env).start()
        for left in (n for n in Store(store).list_models() if "/soak/" in n["name"]):
            _delete(server.url, left["name"])  # an earlier run's: it would share the blobs
        _push_other(server, reg_port, work)
        throttle = Throttle(reg_port, rate=2 << 20)
        name = f"127.0.0.1:{throttle.port}/soak/other:latest"
        _kill_part_way(server, throttle, name)
        at_kill = {"partials": len(_partials(store)), **check_store(store)}
        server = Server(store, work / "server.log", env).start()  # prunes at start-up
        kept = len(_partials(store))
        first, throttle.sent = throttle.sent, 0
        events = list(_stream(server.url, "/api/pull", {"model": name, "insecure": True}))
        again = {"status": events[-1].get("status") or events[-1], "bytes": throttle.sent}
        again["of the whole pull"] = _wire_size(reg, "soak/other")
        chat = {"model": name, "messages": [{"role": "user", "content": "hi"}], "stream": False}
        chat["options"] = {"num_predict": 8}
        answered = httpx.post(server.url + "/api/chat", json=chat, timeout=300).status_code
        httpx.request("DELETE", server.url + "/api/delete", json={"model": name})
        server.stop()
    return {
        "at the kill": at_kill,
        "partial files kept by the restart": f"{kept} of {at_kill['partials']}",
        "bytes before the kill": first,
        "second pull": again,
        "pulled model answers": answered,
    }


def create_kill(work: Path, env: dict[str, str]) -> dict[str, Any]:
    store, weights = work / "store", demo_weights(work)
    server = Server(store, work / "server.log", env).start()
    body = {"model": "soak-create", "from": str(weights)}
    for ev in _stream(server.url, "/api/create", body):
        if ev.get("status") == "converting model":
            server.kill()
            break
    at_kill = check_store(store)
    server = Server(store, work / "server.log", env).start()
    events = list(_stream(server.url, "/api/create", body))
    listed = "soak-create:latest" in check_store(store)["listed"]
    httpx.request("DELETE", server.url + "/api/delete", json={"model": "soak-create"})
    works = reference_chat(server.url) is not None
    server.stop()
    return {
        "at the kill": at_kill,
        "create again": events[-1].get("status"),
        "listed": listed,
        "demo answers": works,
    }


def _delete(url: str, name: str) -> None:
    with contextlib.suppress(httpx.TransportError):  # the server may be killed under it
        httpx.request("DELETE", url + "/api/delete", json={"model": name}, timeout=30)


def delete_kill(work: Path, env: dict[str, str]) -> dict[str, Any]:
    store = work / "store"
    server = Server(store, work / "server.log", env).start()
    outcomes = []
    for delay in (0.0, 0.005, 0.02, 0.05):
        httpx.post(server.url + "/api/copy", json={"source": MODEL, "destination": "soak-rm"})
        threading.Thread(target=_delete, args=(server.url, "soak-rm"), daemon=True).start()
        time.sleep(delay)
        server.kill()
        outcomes.append(check_store(store))
        server = Server(store, work / "server.log", env).start()
    works = reference_chat(server.url) is not None
    httpx.request("DELETE", server.url + "/api/delete", json={"model": "soak-rm"})
    server.stop()
    broken = sum(len(o["broken listed"]) + o["half on disk"] for o in outcomes)
    return {"kills": len(outcomes), "broken or half models": broken, "demo answers": works}


def run(work: Path, env: dict[str, str]) -> dict[str, Any]:
    server = Server(work / "store", work / "server.log", env).start()
    try:
        runner = runner_kill(server)
    finally:
        server.stop()
    return {
        "runner kill": runner,
        "server kill during pull": pull_kill(work, env),
        "server kill during create": create_kill(work, env),
        "server kill during delete": delete_kill(work, env),
        "store at the end": check_store(work / "store"),
    }
