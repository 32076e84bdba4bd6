"""Push and pull against the CNCF distribution registry: Ollama-style manifests with
FreeToken's layers (zstd in frames) round-trip, ranged parts resume, nothing is sent twice."""

from __future__ import annotations

import json

import httpx
import pytest

from freetoken.pull import pull_model, push_model
from freetoken.pull.wire import ZSTD
from freetoken.store import Store
from tests.pull.conftest import OPTIONS, make_cfg
from tests.pull.harness import CountingTransport
from tests.pull.oci import DistributionRegistry
from tests.pull.test_pull import same_files

pytestmark = pytest.mark.slow


@pytest.fixture
def oci(tmp_path):
    with DistributionRegistry(tmp_path / "oci") as reg:
        yield reg


def manifest(reg: DistributionRegistry, repo: str) -> dict:
    r = httpx.get(
        f"{reg.url}/v2/{repo}/manifests/latest",
        headers={"Accept": "application/vnd.docker.distribution.manifest.v2+json"},
    )
    assert r.status_code == 200, r.text
    return json.loads(r.content)


def test_push_then_pull_round_trips_with_zstd_layers(source, oci, tmp_path, hub):
    cfg = make_cfg(tmp_path / "models", oci.url)
    source.copy("wide", "team/wide")
    push_model(source, "team/wide", cfg=cfg, options=OPTIONS)
    wire = manifest(oci, "team/wide")
    shard = next(x for x in wire["layers"] if x["mediaType"] == ZSTD)
    assert shard["annotations"]["org.freetoken.zstd.frames"]  # the frame table travelled
    blob = httpx.get(f"{oci.url}/v2/team/wide/blobs/{shard['digest']}")
    assert blob.status_code == 200 and len(blob.content) == shard["size"]
    dest = Store(tmp_path / "models")
    pull_model(dest, "team/wide", cfg=cfg, transfers=hub)
    same_files(source, dest, "team/wide")
    # a second push finds every blob there and sends only the manifest
    counted = CountingTransport()
    push_model(source, "team/wide", cfg=cfg, options=OPTIONS, transport=counted)
    assert [m for m, _, _ in counted.requests if m in ("PATCH", "POST")] == []


def test_a_stopped_pull_resumes_with_what_it_lacks(source, oci, tmp_path, hub):
    cfg = make_cfg(tmp_path / "models", oci.url)
    source.copy("wide", "team/wide")
    push_model(source, "team/wide", cfg=cfg, options=OPTIONS)
    shard = next(x for x in manifest(oci, "team/wide")["layers"] if x["mediaType"] == ZSTD)

    class Stop(Exception):
        pass

    def stop_half_way(event: dict) -> None:
        if event.get("digest") == shard["digest"] and event["completed"] >= shard["size"] // 2:
            raise Stop

    dest = Store(tmp_path / "models")
    with pytest.raises(Stop):
        pull_model(
            dest,
            "team/wide",
            cfg=cfg,
            transfers=hub,
            progress=stop_half_way,
            transport=CountingTransport(delay=0.01),
        )
    assert hub.wait_idle(10)
    counted = CountingTransport()
    pull_model(dest, "team/wide", cfg=cfg, transfers=hub, transport=counted)
    same_files(source, dest, "team/wide")
    # the distribution registry answered ranges (206), and the rest was less than the whole
    ranged = [r for m, p, r in counted.requests if m == "GET" and shard["digest"] in p]
    assert ranged and all(r and r.startswith("bytes=") for r in ranged)
    assert 0 < counted.bytes[shard["digest"]] < shard["size"]
