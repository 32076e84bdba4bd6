"""A real FreeToken server on loopback, and the real tiny model it serves.

The server runs in a background thread of the test process (uvicorn on a free port), so a
test can reach its residency and runners; the runners are real `freetoken.runtime.runner`
processes loading a real random-weight Qwen3-MoE.
"""

from __future__ import annotations

import atexit
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import uvicorn

from freetoken import config
from freetoken.api import create_app
from freetoken.api.state import Services
from freetoken.store import CreateSpec, Store
from tests.fixtures import SYNTH_TINY

_TINY: Path | None = None
TINY = SYNTH_TINY


def tiny_model_dir() -> Path:
    """A Hugging Face directory (weights, tokenizer, ChatML template), made once per session."""
    global _TINY
    if _TINY is None:
        from freetoken.tools import synth

        root = Path(tempfile.mkdtemp(prefix="freetoken-tiny-"))
        atexit.register(shutil.rmtree, root, ignore_errors=True)
        _TINY = synth.write_qwen3_moe(root / "tiny", **TINY)
    return _TINY


_ENDLESS: Path | None = None


def endless_model_dir() -> Path:
    """The tiny model with no end-of-sequence token: it generates until num_predict, so tests
    that act while a stream is running never race its natural end."""
    global _ENDLESS
    if _ENDLESS is None:
        import json

        src = tiny_model_dir()
        _ENDLESS = src.parent / "endless"
        shutil.copytree(src, _ENDLESS, dirs_exist_ok=True)
        (_ENDLESS / "generation_config.json").write_text("{}")
        for name, key in (("config.json", "eos_token_id"), ("tokenizer_config.json", "eos_token")):
            cfg = json.loads((_ENDLESS / name).read_text())
            cfg[key] = None
            (_ENDLESS / name).write_text(json.dumps(cfg))
    return _ENDLESS


def make_config(models: Path, **env: str) -> Any:
    """Settings from an explicit environment: nothing leaks in from the test machine's."""
    return config.load({"FREETOKEN_MODELS": str(models), "FREETOKEN_DEVICE": "cpu", **env})


_FTW: dict[Path, Path] = {}


def ftw_of(src: Path) -> Path:
    """`src` converted to FTW, once per session. A create from an FTW directory links its
    files where one from a Hugging Face directory runs the converter (2 s a model, three
    models a test server); the create tests exercise that conversion themselves."""
    if src not in _FTW:
        from freetoken.ftw.convert import convert

        _FTW[src] = convert(src, src.parent / f"{src.name}-ftw")
    return _FTW[src]


def add_model(store: Store, name: str, endless: bool = False, **fields: Any) -> None:
    src = ftw_of(endless_model_dir() if endless else tiny_model_dir())
    plan = store.plan_create(CreateSpec(name=name, from_=str(src), **fields))
    for _ in plan.run():
        pass


# The address a local client uses. Starlette's TestClient sends Host "testserver" unless told
# otherwise, and the DNS-rebinding guard rightly refuses that name.
LOCAL_URL = "http://127.0.0.1:11434"


def local_client(cfg: Any, **kwargs: Any) -> Any:
    """A TestClient for the app of `cfg`, talking to it as a local client would."""
    from starlette.testclient import TestClient

    return TestClient(create_app(cfg), base_url=LOCAL_URL, **kwargs)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """`with LiveServer(cfg) as srv:` serves the API at `srv.url` until the block ends;
    `residency` stands in a Residency of the test's (with its own memory figures)."""

    def __init__(self, cfg: Any, residency: Any = None):
        self.cfg = cfg
        self.app = create_app(cfg, residency=residency)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(
            uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    @property
    def services(self) -> Services:
        return self.app.state.services

    def runner_pid(self, name: str) -> int | None:
        runner = self.services.residency.runners().get(name)
        return runner.pid if runner else None

    def __enter__(self) -> LiveServer:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
