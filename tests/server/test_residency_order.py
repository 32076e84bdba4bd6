"""A model's requests are served in arrival order (server/residency.py, `_entry_for`): a
request that needs the model reloaded with other options is not passed by later requests
that the loaded runner could serve, nor by the races while the runner is replaced. Fake
runners on the event loop: the order, not the processes, is under test."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from freetoken.server.residency import Residency
from freetoken.server.runner import RunnerSpec

CFG = SimpleNamespace(
    max_queue=64,
    max_loaded_models=1,
    keep_alive=300.0,
    runner_python="",
    load_timeout=60,
    num_parallel=1,
)
VIEW = SimpleNamespace(name=SimpleNamespace(key=("m",)), digest="sha256:m", display="m")


class FakeRunner:
    def __init__(self, spec: RunnerSpec):
        self.spec, self.alive, self.info = spec, True, {}
        self.started_at = time.monotonic()
        self.exited = asyncio.get_running_loop().create_future()

    async def stop(self) -> None:
        await asyncio.sleep(0.01)  # a process takes a moment to go
        self.alive = False
        if not self.exited.done():
            self.exited.set_result(0)

    async def refresh_info(self) -> None:
        pass


def spec(budget: str) -> RunnerSpec:
    return RunnerSpec("m", {}, 128, 1, {"vram_budget": budget})


async def _served_in_order() -> tuple[list[str], list[str]]:
    loads: list[str] = []

    async def start(s: RunnerSpec, **_) -> FakeRunner:
        await asyncio.sleep(0.02)
        loads.append(s.options["vram_budget"])
        return FakeRunner(s)

    residency = Residency(CFG, start_runner=start)
    served: list[str] = []

    async def request(name: str, budget: str, hold: float) -> None:
        lease = await residency.acquire(VIEW, spec(budget), None)
        served.append(name)
        await asyncio.sleep(hold)
        lease.release()

    first = asyncio.create_task(request("a1", "A", 0.2))  # holds runner A a while
    await asyncio.sleep(0.05)
    tasks = [asyncio.create_task(request("b1", "B", 0.05))]  # needs runner B: waits for a1
    for i in range(2, 6):  # then a stream of requests runner A could serve at once
        await asyncio.sleep(0.01)
        tasks.append(asyncio.create_task(request(f"a{i}", "A", 0.05)))
    await asyncio.wait_for(asyncio.gather(first, *tasks), 10)
    await residency.shutdown()
    return served, loads


def test_a_request_for_another_runner_is_not_passed_by_later_ones():
    served, loads = asyncio.run(_served_in_order())
    # b1 came second and is served second; the later A requests share one more runner A
    assert served == ["a1", "b1", "a2", "a3", "a4", "a5"]
    assert loads == ["A", "B", "A"]
