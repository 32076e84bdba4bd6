"""The runner client against the real runner process."""

import asyncio
import json

import pytest

from freetoken.server.runner import Runner, RunnerError, RunnerRequestError, RunnerSpec
from freetoken.store import Store

from .harness import add_model


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    store = Store(tmp_path_factory.mktemp("models"))
    add_model(store, "tiny")
    return store.runner_files(store.resolve("tiny"))


def spec(files: dict[str, str], **kw) -> RunnerSpec:
    return RunnerSpec(
        name="tiny:latest", files=files, num_ctx=kw.pop("num_ctx", 256), num_parallel=2, **kw
    )


def test_load_complete_cancel_crash(files):
    async def scenario():
        progress = []
        # a context long enough that the stream killed below cannot have been sent whole first
        # (at 4,096 tokens, under the whole suite's load, it once was)
        runner = await Runner.start(
            spec(files, num_ctx=16384), on_progress=lambda d, t: progress.append((d, t))
        )
        try:
            assert runner.alive and runner.info["num_ctx"] == 16384
            body = {
                "kind": "chat",
                "messages": [{"role": "user", "content": "hi"}],
                "options": {"num_predict": 3, "num_ctx": 16384},
            }
            events = [e async for e in runner.completion(body)]
            assert events[-1]["done"] and events[-1]["eval_count"] <= 3
            assert all("content" in e for e in events[:-1])
            bad = {**body, "options": {"temperature": "hot"}}
            with pytest.raises(RunnerRequestError) as e:
                [x async for x in runner.completion(bad)]
            assert e.value.status == 400 and "temperature" in str(e.value)
            # Leaving a stream early closes the connection; the runner drops the sequence.
            long = {**body, "options": {"num_predict": 100000, "num_ctx": 16384}}
            stream = runner.completion(long)
            await anext(stream)
            await stream.aclose()
            for _ in range(100):
                if (await runner.stats())["running"] == 0:
                    break
                await asyncio.sleep(0.02)
            assert (await runner.stats())["running"] == 0
            # A runner that dies mid-stream ends the stream with an error naming the signal.
            got = []
            with pytest.raises(RunnerError, match="unexpectedly stopped.*exit status -9"):
                async for event in runner.completion(long):
                    got.append(event)
                    if len(got) == 1:
                        runner.proc.kill()
            assert got and not runner.alive
            with pytest.raises(RunnerError, match="is not running"):
                await anext(runner.completion(body))
        finally:
            await runner.stop()
        assert not runner.workdir.exists()

    asyncio.run(scenario())


def test_load_error_is_the_runners_message(files, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps({**json.loads(open(files["config.json"]).read()), "model_type": "llama"})
    )

    async def scenario():
        with pytest.raises(RunnerError, match="error loading model: .*llama"):
            await Runner.start(spec({**files, "config.json": str(config)}))

    asyncio.run(scenario())


def test_process_dying_while_loading_reports_exit_status_and_output(files, tmp_path):
    # A "python" that prints a line and exits stands in for a runner killed during load.
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'out of memory while loading' >&2\nexit 3\n")
    fake.chmod(0o755)

    async def scenario():
        with pytest.raises(RunnerError) as e:
            await Runner.start(spec(files), python=str(fake))
        assert "exit status 3" in str(e.value) and "out of memory while loading" in str(e.value)

    asyncio.run(scenario())


def test_spec_file_matches_the_protocol(files):
    s = spec(files, options={"moe_policy": "adaptive"})
    assert set(vars(s)) == {"name", "files", "num_ctx", "num_parallel", "options"}


def test_the_runners_load_judgement_reaches_the_server_log(caplog):
    """Runner output is debug detail, except what the operator should read: the CPU
    kernel's status, the doctor's judgement at load, adaptive's decisions and warnings."""
    import collections
    import logging
    import types

    from freetoken.server.runner import Runner

    r = object.__new__(Runner)
    r._tail, r.proc = collections.deque(maxlen=10), types.SimpleNamespace(pid=7)
    with caplog.at_level(logging.DEBUG, logger="freetoken.server.runner"):
        for line in (
            "t runner INFO CPU experts: C++ (avx2) (built)",
            "t runner INFO doctor: decode: at most 9.0 tok/s",
            "t runner WARNING pinning refused",
            "t runner INFO adaptive: step ms device 1.40, split 1.20 (compared at 4 streams)",
            "t runner INFO ready: 10 KV pages",
        ):
            r._output_line(line.encode())
    levels = {rec.getMessage().split(": ", 1)[1]: rec.levelno for rec in caplog.records}
    assert levels["t runner INFO ready: 10 KV pages"] == logging.DEBUG
    assert levels["t runner INFO doctor: decode: at most 9.0 tok/s"] == logging.INFO
    assert levels["t runner WARNING pinning refused"] == logging.INFO
    assert levels["t runner INFO CPU experts: C++ (avx2) (built)"] == logging.INFO
    decision = "t runner INFO adaptive: step ms device 1.40, split 1.20 (compared at 4 streams)"
    assert levels[decision] == logging.INFO


def test_a_runner_started_ahead_runs_the_load_and_one_that_ended_is_replaced(files, caplog):
    """The load runs in the process started ahead; where that process had ended while it
    waited (killed here), the load starts a runner of its own and succeeds."""
    import os
    import signal
    import sys

    from freetoken.server.runner import MODULE, SPAWN
    from freetoken.spare import AsyncSpare
    from tests import procs

    async def scenario():
        spare = AsyncSpare(MODULE, **SPAWN)
        await spare.start(sys.executable)
        try:
            waiting = spare.pid
            runner = await Runner.start(spec(files), spare=spare)
            assert runner.pid == waiting and runner.ahead
            await runner.stop()
            killed = spare.pid  # the next one, started once that load was done
            assert killed not in (None, waiting)
            os.kill(killed, signal.SIGKILL)
            procs.wait_gone(killed)
            await _loads_without(spare, killed)
            # ended just as it was handed the job: the load finds out, and starts one
            take = spare.take

            def take_one_that_ends(argv, python):
                proc = take(argv, python)
                proc.kill()
                return proc

            spare.take = take_one_that_ends
            await spare.refill()
            await _loads_without(spare, spare.pid)
        finally:
            await spare.close()

    async def _loads_without(spare, dead):
        runner = await Runner.start(spec(files), spare=spare)
        try:
            assert runner.pid != dead and not runner.ahead and runner.alive
        finally:
            await runner.stop()

    caplog.set_level("WARNING", logger="freetoken.server.runner")
    asyncio.run(scenario())
    assert "the runner started ahead for tiny:latest had ended; starting one" in caplog.text
