"""The `freetoken` command against the real server, each in its own process, on loopback.

One server (with its runner) serves the whole module; the model is a tiny random-weight
Qwen3-MoE, so answers are gibberish and only their shape is checked. The interactive chat
runs under a pseudo-terminal, as a person would use it.
"""

from __future__ import annotations

import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

import freetoken
from tests import fixtures

pytestmark = pytest.mark.slow

MODELFILE = """FROM ./weights
PARAMETER temperature 0
PARAMETER num_predict 8
SYSTEM \"\"\"You are a test model.\"\"\"
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(tmp: Path, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OLLAMA_", "FREETOKEN_"))}
    env.update(
        FREETOKEN_HOST=f"127.0.0.1:{port}",
        FREETOKEN_MODELS=str(tmp / "models"),
        FREETOKEN_NOHISTORY="1",
        TERM="dumb",
        PYTHONUNBUFFERED="1",
    )
    # The checkout may not be installed; commands run from other directories must still find it.
    root = str(Path(freetoken.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli-e2e")
    env = _env(tmp, _free_port())
    log = (tmp / "server.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "freetoken", "serve"], env=env, stdout=log, stderr=subprocess.STDOUT
    )
    url = "http://" + env["FREETOKEN_HOST"]
    deadline = time.monotonic() + 60
    while True:
        try:
            httpx.head(url + "/", timeout=1, trust_env=False)
            break
        except httpx.TransportError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail("server did not start:\n" + (tmp / "server.log").read_text())
            time.sleep(0.1)
    yield tmp, env
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


def cli(env, *args, stdin: str = "", cwd=None, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "freetoken", *args],
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def model(server):
    tmp, env = server
    project = tmp / "project"
    fixtures.hf_qwen3_moe(project / "weights")
    (project / "Modelfile").write_text(MODELFILE)
    # Run from elsewhere: FROM must resolve against the Modelfile's directory.
    r = cli(env, "create", "clitest", "-f", str(project / "Modelfile"), cwd=tmp)
    assert r.returncode == 0, r.stderr
    assert r.stderr.startswith("gathering model components\n")
    # the server is on this machine: it reads the directory in place, nothing is uploaded
    assert "converting model" in r.stderr and "copying file" not in r.stderr
    assert r.stderr.rstrip().endswith("success")
    return "clitest"


def test_create_with_a_missing_from_path(server, tmp_path):
    _, env = server
    (tmp_path / "Modelfile").write_text("FROM ./not-here\n")
    r = cli(env, "create", "broken", "-f", str(tmp_path / "Modelfile"))
    assert r.returncode == 1
    assert re.search(r"^Error: .*path '.*not-here' does not exist", r.stderr, re.M)


def test_run_one_prompt(server, model):
    _, env = server
    r = cli(env, "run", model, "Hello there")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() and r.stdout.endswith("\n")
    assert r.stderr == ""


def test_run_verbose(server, model):
    _, env = server
    r = cli(env, "run", "--verbose", model, "Hello")
    assert r.returncode == 0, r.stderr
    for label in (
        "total duration:",
        "load duration:",
        "prompt eval count:",
        "prompt eval duration:",
        "prompt eval rate:",
        "eval count:",
        "eval duration:",
        "eval rate:",
    ):
        assert label in r.stderr
    assert re.search(r"^eval count:\s+8 token\(s\)$", r.stderr, re.M)


def test_run_piped_prompt(server, model):
    _, env = server
    r = cli(env, "run", model, stdin="a prompt from a pipe\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()


def test_run_unknown_model_reports_the_pull_error(server):
    _, env = server
    r = cli(env, "run", "no-such-model", "hi")
    assert r.returncode == 1
    assert r.stderr.startswith("Error: ") or "\nError: " in r.stderr


def _own_terminal() -> None:
    # A session of its own with the pty as controlling terminal, so Ctrl-C becomes SIGINT.
    import fcntl
    import termios

    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    # as at a real terminal, whatever the test runner inherited: a shell that starts a job in
    # the background without job control leaves SIGINT ignored, and exec keeps it so
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Terminal:
    """A child process on a pseudo-terminal, read and written like a person at a keyboard.

    The tiny model's tokenizer was trained on docstrings, so its gibberish can contain
    `>>> `; waits are therefore anchored after output only the CLI prints.
    """

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        import pty

        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen(
            argv, env=env, stdin=slave, stdout=slave, stderr=slave, preexec_fn=_own_terminal
        )
        os.close(slave)
        self.output = ""

    def _read(self, timeout: float) -> bool:
        ready, _, _ = select.select([self.master], [], [], timeout)
        if not ready:
            return True
        try:
            data = os.read(self.master, 65536)
        except OSError:
            return False
        if not data:
            return False
        self.output += data.decode("utf-8", "replace")
        return True

    def expect(self, text: str, after: int = 0, timeout: float = 120) -> int:
        """Waits for `text` at or after position `after`; returns the position just past it."""
        deadline = time.monotonic() + timeout
        while (i := self.output.find(text, after)) < 0:
            if time.monotonic() > deadline or not self._read(0.2):
                raise AssertionError(f"waited for {text!r}; got:\n{self.output}")
        return i + len(text)

    def command(self, line: str, reply: str, after: int) -> int:
        """Sends a slash command and waits for its reply and the next prompt."""
        self.send(line)
        return self.expect(">>> ", self.expect(reply, after))

    def send(self, line: str) -> None:
        os.write(self.master, line.encode() + b"\r")

    def wait(self, timeout: float = 60) -> int:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            self._read(0.2)
        while self._read(0):
            if not select.select([self.master], [], [], 0)[0]:
                break
        rc = self.proc.wait(timeout=5)
        os.close(self.master)
        return rc

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _stats(text: str) -> list[int]:
    """The eval counts of the `--verbose` blocks in `text`."""
    return [int(n) for n in re.findall(r"(?m)^eval count:\s+(\d+) token", text)]


@pytest.mark.skipif(sys.platform == "win32", reason="needs a pseudo-terminal")
def test_interactive_chat(server, model):
    _, env = server
    term = Terminal([sys.executable, "-m", "freetoken", "run", model], env)
    try:
        pos = term.expect(">>> ")
        pos = term.command("/set verbose", "Set 'verbose' mode.", pos)
        term.send('"""Hello')
        pos = term.expect("... ", pos)
        term.send('there"""')
        pos = term.expect(">>> ", term.expect("\neval rate:", pos))
        # The two lines went out as one message: one answer, one stats block.
        assert _stats(term.output) == [8]
        pos = term.command(
            "/set parameter num_predict 5", "Set parameter 'num_predict' to '5'", pos
        )
        pos = term.command("/show info", "experts used", pos)
        assert "context length      512" in term.output
        pos = term.command("/clear", "Cleared session context", pos)
        term.send("again")
        pos = term.expect(">>> ", term.expect("\neval rate:", pos))
        assert _stats(term.output)[1] <= 5
        term.send("/bye")
        assert term.wait() == 0
    finally:
        term.close()


def test_ctrl_c_stops_the_answer_and_returns_to_the_prompt(server, model):
    _, env = server
    term = Terminal([sys.executable, "-m", "freetoken", "run", model], env)
    try:
        pos = term.expect(">>> ")
        pos = term.command("/set verbose", "Set 'verbose' mode.", pos)
        pos = term.command("/set parameter num_predict 400", "to '400'", pos)
        term.send("go on for a while")
        pos = term.expect("go on for a while", pos)
        while len(term.output) <= pos + 4:  # the answer has started
            assert term._read(30), term.output
        os.write(term.master, b"\x03")
        # Only a REPL back at its prompt answers the next command.
        pos = term.command("/set parameter num_predict 3", "to '3'", pos)
        assert _stats(term.output) == []  # the cancelled answer never finished
        term.send("short one")
        pos = term.expect(">>> ", term.expect("\neval rate:", pos))
        assert _stats(term.output) == [3]
        term.send("/bye")
        assert term.wait() == 0
    finally:
        term.close()


def test_list_ps_show(server, model):
    _, env = server
    cli(env, "run", model, "warm up")
    r = cli(env, "list")
    assert r.returncode == 0
    header, *rows = r.stdout.splitlines()
    assert header.split() == ["NAME", "ID", "SIZE", "MODIFIED"]
    assert any(row.startswith(f"{model}:latest ") for row in rows)
    r = cli(env, "ps")
    assert r.returncode == 0
    assert r.stdout.splitlines()[0].split() == [
        "NAME",
        "ID",
        "SIZE",
        "PROCESSOR",
        "CONTEXT",
        "UNTIL",
    ]
    assert f"{model}:latest" in r.stdout and "from now" in r.stdout
    r = cli(env, "show", model)
    assert r.returncode == 0
    assert "  Model\n" in r.stdout and "    experts used        2\n" in r.stdout
    assert "You are a test model." in r.stdout
    r = cli(env, "show", model, "--modelfile")
    assert "PARAMETER temperature 0" in r.stdout


def test_cp_stop_rm(server, model):
    _, env = server
    assert cli(env, "cp", model, "clitest-copy").returncode == 0
    assert cli(env, "stop", model).returncode == 0
    r = cli(env, "rm", "clitest-copy")
    assert (r.returncode, r.stdout) == (0, "deleted 'clitest-copy'\n")
    assert "clitest-copy" not in cli(env, "list").stdout
    r = cli(env, "rm", "clitest-copy")
    assert r.returncode == 1 and r.stderr.startswith("Error: ")


def test_version_against_the_server(server):
    _, env = server
    r = cli(env, "--version")
    assert r.returncode == 0 and r.stdout.startswith("freetoken version is ")
    assert r.stderr == ""


def test_not_running(tmp_path):
    port = _free_port()
    r = cli(_env(tmp_path, port), "list")
    assert r.returncode == 1
    assert f"127.0.0.1:{port}" in r.stderr and "is it running" in r.stderr


def test_serve_with_a_bad_setting(tmp_path):
    env = _env(tmp_path, 1)
    env["FREETOKEN_KEEP_ALIVE"] = "sometimes"
    r = cli(env, "serve", timeout=30)
    assert r.returncode != 0
    assert "FREETOKEN_KEEP_ALIVE" in r.stderr
