"""The CNCF distribution registry (Debian's `docker-registry` package) on loopback, for the
tests that check FreeToken speaks to a real OCI registry and not only to its own."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.pull.harness import free_port

_CONFIG = """version: 0.1
log:
  level: error
storage:
  filesystem:
    rootdirectory: {root}
  delete:
    enabled: true
http:
  addr: 127.0.0.1:{port}
"""


def binary() -> str:
    found = shutil.which("docker-registry") or shutil.which("registry")
    if found is None:
        pytest.skip(
            "the CNCF distribution registry is not installed (Debian's docker-registry "
            "package; scripts/setup installs it where it runs as root)"
        )
    return found


class DistributionRegistry:
    """`with DistributionRegistry(root) as reg:` serves an empty registry at `reg.url`."""

    def __init__(self, root: Path):
        self.root = root
        self.port = free_port()
        self.host = f"127.0.0.1:{self.port}"
        self.url = f"http://{self.host}"
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> DistributionRegistry:
        exe = binary()
        self.root.mkdir(parents=True, exist_ok=True)
        config = self.root / "config.yml"
        config.write_text(_CONFIG.format(root=self.root / "data", port=self.port))
        self.proc = subprocess.Popen(
            [exe, "serve", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(self.url + "/v2/", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                pytest.skip(f"docker-registry did not start: {err.strip()[-300:]}")
            assert time.monotonic() < deadline, "docker-registry did not answer"
            time.sleep(0.1)

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None
        self.proc.terminate()
        self.proc.wait(timeout=20)
