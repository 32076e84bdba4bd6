"""Models to push and pull, a fresh real registry per test, and settings pointing at it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from freetoken import config
from freetoken.pull import TransferOptions, Transfers, push_model
from freetoken.store import CreateSpec, Store
from freetoken.tools import synth
from tests.fixtures import SYNTH_TINY
from tests.pull.harness import ThreadRegistry

# SYNTH_TINY with wider experts: its FTW shard (7.5 MB) travels zstd-compressed in parts.
WIDE = {
    **SYNTH_TINY,
    "hidden_size": 256,
    "intermediate_size": 256,
    "moe_intermediate_size": 128,
    "num_experts": 16,
}
# Small parts, frames and checkpoints, and quick retries: a few MB exercise several
# streams, several frames per part and saved hash states, and give up fast.
OPTIONS = TransferOptions(
    streams=4,
    part_size=1 << 20,
    min_part_size=256 << 10,
    retries=2,
    backoff=0.05,
    stall_timeout=5.0,
    state_every=64 << 10,
    verified_every=512 << 10,
    upload_chunk=2 << 20,
    frame_size=256 << 10,
)


def make_cfg(models: Path, registry: str = "", **env: str) -> Any:
    return config.load(
        {
            "FREETOKEN_MODELS": str(models),
            "FREETOKEN_REGISTRY": registry,
            "FREETOKEN_DEVICE": "cpu",
            **env,
        }
    )


@pytest.fixture(scope="session")
def source(tmp_path_factory: pytest.TempPathFactory) -> Store:
    """A store holding `tiny` (all files small) and `wide` (one large, compressible shard)."""
    root = tmp_path_factory.mktemp("source")
    store = Store(root / "models")
    for name, dims in (("tiny", SYNTH_TINY), ("wide", WIDE)):
        src = synth.write_qwen3_moe(root / name, **dims)
        for _ in store.plan_create(CreateSpec(name=name, from_=str(src), system="Be brief.")).run():
            pass
    return store


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[ThreadRegistry]:
    with ThreadRegistry(tmp_path / "registry") as reg:
        yield reg


@pytest.fixture
def cfg(tmp_path: Path, registry: ThreadRegistry) -> Any:
    return make_cfg(tmp_path / "models", registry.url)


@pytest.fixture
def hub() -> Iterator[Transfers]:
    transfers = Transfers(OPTIONS)
    yield transfers
    transfers.close()


@pytest.fixture
def dest(tmp_path: Path) -> Store:
    return Store(tmp_path / "models")


def publish(source: Store, cfg: Any, *names: str) -> None:
    """Pushes models of the source store to the registry `cfg` names."""
    for name in names:
        push_model(source, name, cfg=cfg, options=OPTIONS)


def shard(store: Store, name: str) -> str:
    """The digest of the model's FTW shard (its one large file)."""
    return store.resolve(name).files["ftw-00000.bin"]
