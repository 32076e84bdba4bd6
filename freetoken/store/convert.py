"""Conversion to FTW during create, in a child process (the server never imports torch).

The converter prints JSON progress lines; they become Ollama-style create statuses, and
its last line names each file's digest, hashed as it was written. Its output directory
lives next to the blobs, so each file is renamed into the store, neither copied nor read
again. A server keeps a converter started ahead (`SPARE`, freetoken/spare.py) so a create
does not wait for torch's import.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Generator
from pathlib import Path
from typing import Any

from freetoken import gguf_split
from freetoken.spare import Spare

__all__ = ["SPARE", "ConversionFailed", "run_converter", "source_of_files", "work_dir"]

WORK_PREFIX = ".convert-"
MODULE = "freetoken.ftw.convert"
_PIPES = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
# this process's converter started ahead: `freetoken serve` turns it on (FREETOKEN_WARM_START)
SPARE = Spare(MODULE, **_PIPES)


class ConversionFailed(RuntimeError):
    """The converter exited with an error; the message carries its last words."""


def interpreter() -> str:
    """The converter's interpreter (the runners' setting; default: this one)."""
    from freetoken import config

    return config.current().runner_python or sys.executable


def work_dir(store_root: Path) -> Path:
    """A fresh scratch directory on the store's filesystem (so results can be renamed in)."""
    store_root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=WORK_PREFIX, dir=store_root))


def source_of_files(files: dict[str, Path], into: Path) -> Path:
    """A directory of links named like the model's files, pointing at them (blobs, or the
    files of a directory on this machine, read in place)."""
    src = into / "source"
    src.mkdir()
    for name, path in files.items():
        (src / name).symlink_to(path)
    gguf = [n for n in files if n.endswith(".gguf")]
    if len(gguf) == len(files) and (len(gguf) == 1 or gguf_split.first_of(gguf)):
        # a GGUF file, or a split one's parts: the converter finds the others beside the first
        return src / (gguf[0] if len(gguf) == 1 else gguf_split.first_of(gguf))
    return src


def run_converter(
    src: Path, out: Path, label: str, quantize: str | None = None
) -> Generator[dict[str, Any], None, dict[str, str]]:
    """Runs `freetoken.ftw.convert` (quantizing the experts where asked), yielding progress;
    returns the digests of the files it wrote (by name). Raises ConversionFailed, naming
    the source as `label`."""
    args = [str(src), str(out), "--json-progress"]
    if quantize:
        args += ["--quantize", quantize]
    python = interpreter()
    proc = SPARE.take(args, python)
    if proc is None:
        proc = subprocess.Popen([python, "-m", MODULE, *args], **_PIPES)
    try:
        if quantize:
            yield {"status": f"quantizing the experts to {quantize}"}
        yield {"status": "converting model"}
        assert proc.stdout is not None
        digests: dict[str, str] = {}
        for line in proc.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            status = event.get("status")
            if status == "success":
                digests = dict(event.get("digests") or {})
            elif status == "converting model":
                yield {
                    "status": "converting model",
                    "total": event.get("total"),
                    "completed": event.get("completed"),
                }
            elif isinstance(status, str):
                yield {"status": status}  # a note the converter wants the user to see
        err = proc.stderr.read() if proc.stderr else ""
        if proc.wait() != 0:
            last = [ln for ln in err.strip().splitlines() if ln.strip()][-1:] or [
                f"exit code {proc.returncode}"
            ]
            if os.strerror(errno.ENOSPC) in err:  # the disk, not the model: a 507 like any write
                raise OSError(errno.ENOSPC, f"converting {src.name} to FTW: {last[0]}")
            raise ConversionFailed(
                f"converting {label} to FTW failed: {last[0].removeprefix('error: ')}"
            )
        return digests
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        SPARE.refill()  # for the next create, now that this one's cores are free


def cleanup(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
