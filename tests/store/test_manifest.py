import hashlib
import json

import pytest

from freetoken.store import manifest as mf


def sample() -> mf.Manifest:
    config = mf.Layer(mf.CONFIG, "sha256:" + "a" * 64, 10)
    layers = (
        mf.Layer(mf.FILE, "sha256:" + "b" * 64, 20, "config.json"),
        mf.Layer(mf.TEMPLATE, "sha256:" + "c" * 64, 30),
    )
    return mf.Manifest(config, layers)


def test_wire_shape_and_media_types():
    obj = json.loads(sample().to_bytes())
    assert obj["schemaVersion"] == 2
    assert obj["mediaType"] == "application/vnd.docker.distribution.manifest.v2+json"
    assert obj["config"] == {
        "mediaType": "application/vnd.docker.container.image.v1+json",
        "digest": "sha256:" + "a" * 64,
        "size": 10,
    }
    assert obj["layers"][0] == {
        "mediaType": "application/vnd.freetoken.file",
        "digest": "sha256:" + "b" * 64,
        "size": 20,
        "name": "config.json",
    }
    assert obj["layers"][1]["mediaType"] == "application/vnd.ollama.image.template"
    assert "name" not in obj["layers"][1]
    for t in (mf.SYSTEM, mf.PARAMS, mf.MESSAGES, mf.LICENSE, mf.GGUF):
        assert t.startswith("application/vnd.ollama.image.")


def test_write_read_round_trip_and_digest(tmp_path):
    path = tmp_path / "manifests" / "h" / "ns" / "m" / "latest"
    digest = mf.write(path, sample())
    assert digest == hashlib.sha256(path.read_bytes()).hexdigest()
    assert mf.read(path) == (sample(), digest)
    assert sorted(p.name for p in path.parent.iterdir()) == ["latest"]  # no temp file left
    assert sample().size == 60 and len(sample().digests()) == 3


@pytest.mark.parametrize(
    "data",
    [
        b"not json",
        b"[]",
        b'{"schemaVersion": 1, "config": {}}',
        b'{"schemaVersion": 2, "config": {"digest": "x"}}',
    ],
)
def test_bad_manifests_raise(data):
    with pytest.raises(mf.ManifestError):
        mf.Manifest.from_bytes(data)
