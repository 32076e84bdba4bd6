"""The README's pip commands, resolved by pip with a plain configuration (no local wheel
cache, no extra index): the CPU-only line must bring torch's CPU build and no NVIDIA
packages, the GPU line torch's CUDA build. A dry run: nothing is installed."""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def readme_commands() -> dict[str, list[str]]:
    """The `pip install` lines of the README's install section, by the comment above each."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Install", 1)[1].split("\n## ", 1)[0]
    found, label = {}, ""
    for line in section.splitlines():
        if line.startswith("# "):
            label = line
        elif line.startswith("pip install "):
            found["cpu" if "without" in label else "gpu"] = line.split("#")[0].split()[2:]
    return found


def test_the_readme_has_both_lines():
    commands = readme_commands()
    assert set(commands) == {"cpu", "gpu"}
    assert "https://download.pytorch.org/whl/cpu" in commands["cpu"]
    for words in commands.values():
        assert "." in words and any(re.fullmatch(r'"?torch==[\d.]+"?', w) for w in words)


def resolve(words: list[str], tmp_path: Path) -> tuple[dict[str, str], str]:
    report = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull  # no pip.conf anywhere: what an ordinary machine has
    args = [w.strip('"') for w in words]
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--quiet",
            "--retries",
            "1",
            "--report",
            str(report),
            *args,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if r.returncode != 0:
        pytest.skip(f"pip could not resolve from the public indexes here: {r.stderr[-300:]}")
    items = json.loads(report.read_text())["install"]
    return {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in items}, r.stderr


@pytest.mark.skipif(platform.machine() != "x86_64", reason="PyPI's CUDA torch is x86-64 Linux")
def test_the_gpu_line_resolves_a_cuda_torch(tmp_path):
    versions, _ = resolve(readme_commands()["gpu"], tmp_path)
    assert "+cpu" not in versions["torch"]
    assert any(name.startswith("nvidia-") for name in versions)


def test_the_cpu_line_resolves_a_cpu_torch_and_no_nvidia_packages(tmp_path):
    import httpx

    words = readme_commands()["cpu"]
    index = words[words.index("--extra-index-url") + 1]
    try:
        httpx.get(index.rstrip("/") + "/torch/", timeout=15).raise_for_status()
    except httpx.HTTPError as e:
        pytest.skip(f"PyTorch's CPU wheel index cannot be reached from this machine: {e}")
    versions, _ = resolve(words, tmp_path)
    assert versions["torch"].endswith("+cpu")
    assert not [name for name in versions if name.startswith("nvidia-")]
