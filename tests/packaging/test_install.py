"""packaging/install.sh as a user runs it: into a fresh directory, then `freetoken --version`
and a chat with the demo model pulled from the registry the wheel ships.

It installs this checkout and torch with pip's own configuration (a local wheel cache
where the machine has one); where pip cannot get them, the test says so and skips."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.procs import wait_answering

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _clean_env(**extra: str) -> dict[str, str]:
    """This environment without FreeToken's settings or a PYTHONPATH that would import the
    checkout instead of what was installed."""
    drop = ("FREETOKEN_", "OLLAMA_", "PYTHONPATH", "VIRTUAL_ENV")
    return {**{k: v for k, v in os.environ.items() if not k.startswith(drop)}, **extra}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    prefix = tmp_path_factory.mktemp("install")
    r = subprocess.run(
        [str(ROOT / "packaging/install.sh"), "--prefix", str(prefix), "--bin", str(prefix / "bin")],
        # a cache of its own, as on a fresh machine: the kernel it builds is never the one
        # this checkout's tests load (they may run beside it)
        env=_clean_env(PYTHON=sys.executable, FREETOKEN_CACHE_DIR=str(prefix / "cache")),
        capture_output=True,
        text=True,
        timeout=900,
    )
    if r.returncode and ("No matching distribution" in r.stderr or "Could not" in r.stderr):
        pytest.skip(f"pip could not get the packages here: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, r.stderr
    assert "no GPU found: torch" in r.stderr or "GPU found" in r.stderr
    return prefix


def _installed_registry(python: Path, tmp_path: Path) -> Path:
    """A copy of the demo registry the installed package ships (not this checkout's)."""
    where = (
        "import freetoken.registry as r, pathlib; "
        "print(pathlib.Path(r.__file__).parent / 'embedded')"
    )
    found = subprocess.run(
        [str(python), "-c", where],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=_clean_env(),
        check=True,
    ).stdout.strip()
    assert not found.startswith(str(ROOT))
    root = tmp_path / "registry"
    shutil.copytree(found, root)
    return root


def _start(cmd: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen:
    out = subprocess.DEVNULL
    return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=out)


def test_the_installed_command_runs_and_serves_the_demo(installed, tmp_path):
    ft = installed / "bin" / "freetoken"
    assert ft.is_symlink() and ft.resolve() == installed / "venv" / "bin" / "freetoken"
    version = subprocess.run(
        [str(ft), "--version"], capture_output=True, text=True, timeout=60, env=_clean_env()
    )
    assert version.stdout.startswith("freetoken version is "), version.stderr
    python = installed / "venv" / "bin" / "python"
    root = _installed_registry(python, tmp_path)
    reg_port, port = _free_port(), _free_port()
    env = _clean_env(
        FREETOKEN_CACHE_DIR=str(installed / "cache"),
        FREETOKEN_HOST=f"127.0.0.1:{port}",
        FREETOKEN_MODELS=str(tmp_path / "models"),
        FREETOKEN_REGISTRY=f"http://127.0.0.1:{reg_port}",
    )
    registry = [str(python), "-m", "freetoken.registry", "serve", "--root", str(root)]
    procs = [
        _start([*registry, "--port", str(reg_port)], env, tmp_path),
        _start([str(ft), "serve"], env, tmp_path),
    ]
    try:
        wait_answering(f"http://127.0.0.1:{reg_port}/v2/", procs[0], 120)
        wait_answering(f"http://127.0.0.1:{port}/", procs[1], 120)
        run = lambda *a: subprocess.run(  # noqa: E731
            [str(ft), *a], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600
        )
        pulled = run("pull", "demo")
        assert pulled.returncode == 0, pulled.stderr
        assert f"pulling manifest (http://127.0.0.1:{reg_port})" in pulled.stderr
        chat = run("run", "demo", "Why is the sky blue?")
        assert chat.returncode == 0, chat.stderr
        assert chat.stdout.strip()  # random weights: words, not sense
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)


def test_the_service_unit_is_valid_for_the_installed_command(installed, tmp_path):
    if not shutil.which("systemd-analyze"):
        pytest.skip("systemd-analyze is not installed")
    unit = (ROOT / "packaging/freetoken.service").read_text()
    unit = unit.replace("/opt/freetoken/venv", str(installed / "venv"))
    path = tmp_path / "freetoken.service"
    path.write_text(
        unit.replace("User=freetoken", "User=root").replace("Group=freetoken", "Group=root")
    )
    r = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True)
    assert r.returncode == 0 and not r.stderr.strip(), r.stderr
