"""A registry model whose weights are a GGUF layer (as on an Ollama-style registry) is
converted to FTW on pull, and the pulled model answers /api/generate."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import ollama

from freetoken.pull.client import RegistryClient
from freetoken.pull.wire import WireLayer, WireManifest
from freetoken.store import manifest as mf
from tests import fixtures
from tests.fixtures_gguf import write_gguf
from tests.pull.conftest import make_cfg
from tests.server.harness import LiveServer


def upload(client: RegistryClient, repo: str, data: bytes) -> str:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    location = client.start_upload(repo)
    location = client.upload_chunk(location, [data], 0, len(data))
    client.finish_upload(location, digest)
    return digest


def publish_gguf(url: str, gguf: Path) -> WireManifest:
    """Pushes the GGUF as Ollama's registry holds models: config, model, params, system."""
    client = RegistryClient(url)
    repo = "library/gguf-tiny"
    config = json.dumps(
        {
            "model_format": "gguf",
            "model_family": "qwen3moe",
            "model_type": "1M",
            "file_type": "F32",
            "architecture": "amd64",
            "os": "linux",
        }
    ).encode()
    params = json.dumps({"temperature": 0, "num_predict": 4}).encode()
    system = b"You are a test model."
    layers = []
    for media_type, data in (
        (mf.GGUF, gguf.read_bytes()),
        (mf.PARAMS, params),
        (mf.SYSTEM, system),
    ):
        layers.append(WireLayer(media_type, upload(client, repo, data), len(data)))
    config_layer = WireLayer(mf.CONFIG, upload(client, repo, config), len(config))
    wire = WireManifest(config_layer, tuple(layers))
    client.put_manifest(repo, "latest", wire.to_bytes())
    client.close()
    return wire


def test_a_gguf_layer_is_converted_on_pull(tmp_path, registry):
    hf_dir = tmp_path / "hf"
    model = fixtures.hf_qwen3_moe(hf_dir, seed=7)
    wire = publish_gguf(registry.url, write_gguf(model, hf_dir, tmp_path / "m.gguf", "F32"))
    with LiveServer(make_cfg(tmp_path / "models", registry.url)) as server:
        client = ollama.Client(host=server.url)
        statuses = [e.status for e in client.pull("gguf-tiny", stream=True)]
        assert "converting model" in statuses and statuses[-1] == "success"
        assert statuses.index("converting model") > statuses.index("verifying sha256 digest")
        store = server.services.store
        view = store.resolve("gguf-tiny")
        # FTW files instead of the GGUF; the params and system layers kept as they were.
        assert not view.manifest.by_type(mf.GGUF)
        assert {"ftw.json", "config.json", "tokenizer.json"} <= set(view.files)
        assert view.params == {"temperature": 0, "num_predict": 4}
        assert view.system == "You are a test model."
        assert view.info["model_format"] == "ftw"
        # The GGUF and the registry's config blob are not kept once converted.
        for layer in (wire.layers[0], wire.config):
            assert not store.blobs.has(layer.digest)
        r = client.generate("gguf-tiny", "hello")
        assert r.done and r.eval_count == 4
