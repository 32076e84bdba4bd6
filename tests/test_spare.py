"""freetoken/spare.py: an interpreter started ahead runs its job with its imports already
done, and ends without one when its holder closes or goes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from freetoken.spare import Spare
from tests import procs

# A module that notes when it was imported and, when run, what it was given and by whom.
_JOB = """
import os, sys, time
from pathlib import Path
OUT = Path(os.environ["SPARE_TEST_OUT"])
(OUT / f"imported-{os.getpid()}").write_text(str(time.time()))
def main(argv):
    print("ran", os.getpid(), *argv, flush=True)
    if argv[:1] == ["fail"]:
        raise SystemExit(3)
"""


@pytest.fixture
def spare(tmp_path):
    (tmp_path / "spare_job.py").write_text(textwrap.dedent(_JOB))
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env["SPARE_TEST_OUT"] = str(tmp_path)
    s = Spare("spare_job", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    yield s
    s.close()


def _imported(out: Path, pid: int, seconds: float = 30) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if (out / f"imported-{pid}").exists():
            return True
        time.sleep(0.02)
    return False


def test_the_job_runs_in_the_interpreter_started_ahead(spare, tmp_path):
    spare.start(sys.executable)
    pid = spare.pid
    assert pid is not None and _imported(tmp_path, pid)
    proc = spare.take(["a", "b c"], sys.executable)
    assert proc is not None and proc.pid == pid
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert out.split() == ["ran", str(pid), "a", "b", "c"]
    assert spare.pid is None  # the next one starts when asked, not during the job
    spare.refill()
    assert spare.pid not in (None, pid)


def test_a_job_handed_over_during_the_imports_waits_for_them(spare, tmp_path):
    spare.start(sys.executable)
    proc = spare.take(["early"], sys.executable)  # most likely still importing
    assert proc is not None
    out, _ = proc.communicate(timeout=30)
    assert out.split() == ["ran", str(proc.pid), "early"]


def test_the_job_s_exit_status_is_the_process_s(spare):
    spare.start(sys.executable)
    proc = spare.take(["fail"], sys.executable)
    assert proc is not None
    proc.communicate(timeout=30)
    assert proc.returncode == 3


def test_no_spare_when_off_dead_or_of_another_python(spare, tmp_path):
    assert spare.take(["x"], sys.executable) is None  # never started
    spare.start(sys.executable)
    assert spare.take(["x"], "/another/python") is None  # and that one is ended
    spare.refill()
    pid = spare.pid
    assert pid is not None and _imported(tmp_path, pid)
    os.kill(pid, 9)
    time.sleep(0.2)
    assert spare.take(["x"], sys.executable) is None
    spare.refill()
    assert spare.pid not in (None, pid)


def test_closing_ends_the_waiting_one_without_running_anything(spare, tmp_path):
    spare.start(sys.executable)
    pid = spare.pid
    assert pid is not None and _imported(tmp_path, pid)
    spare.close()
    assert not procs.running(pid) and not spare.on and spare.pid is None
    spare.refill()  # off: starts nothing
    assert spare.pid is None


def test_a_spare_whose_holder_is_gone_exits_without_its_job(tmp_path):
    """The holder killed (no close): end of input reaches the spare, which ends."""
    (tmp_path / "spare_job.py").write_text(textwrap.dedent(_JOB))
    holder = textwrap.dedent(
        """
        import subprocess, sys
        from freetoken.spare import Spare
        s = Spare("spare_job", stdout=subprocess.DEVNULL)
        s.start(sys.executable)
        print(s.pid, flush=True)
        sys.stdin.readline()
        """
    )
    env = {**os.environ, "SPARE_TEST_OUT": str(tmp_path)}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(Path.cwd()), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen(
        [sys.executable, "-c", holder], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
    )
    assert proc.stdout is not None
    pid = int(proc.stdout.readline())
    assert _imported(tmp_path, pid)
    proc.kill()
    proc.wait()
    procs.wait_gone(pid)


def test_the_event_loop_s_spare_runs_its_job_and_ends_when_closed(tmp_path):
    import asyncio

    from freetoken.spare import AsyncSpare

    (tmp_path / "spare_job.py").write_text(textwrap.dedent(_JOB))
    env = {**os.environ, "SPARE_TEST_OUT": str(tmp_path)}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])

    async def run() -> tuple[bytes, int, int, int | None]:
        spare = AsyncSpare("spare_job", stdout=asyncio.subprocess.PIPE, env=env)
        await spare.start(sys.executable)
        pid = spare.pid
        assert pid is not None and _imported(tmp_path, pid)
        proc = spare.take(["x"], sys.executable)
        assert proc is not None and proc.pid == pid and spare.pid is None
        out, _ = await proc.communicate()
        await spare.refill()
        waiting = spare.pid
        await spare.close()
        return out, pid, proc.returncode, waiting

    out, pid, code, waiting = asyncio.run(run())
    assert out.split() == [b"ran", str(pid).encode(), b"x"] and code == 0
    assert waiting not in (None, pid) and not procs.running(waiting)
