import json

import pytest

from freetoken.pull.wire import ZSTD, WireLayer, WireManifest, locate
from freetoken.store import InvalidName
from freetoken.store import manifest as mf

D1 = "sha256:" + "1" * 64
D2 = "sha256:" + "2" * 64
D3 = "sha256:" + "3" * 64


@pytest.mark.parametrize(
    "text, registry, insecure, local, url",
    [
        # Without FREETOKEN_REGISTRY: Ollama's registry, over https.
        (
            "demo",
            "",
            False,
            "registry.ollama.ai/library/demo:latest",
            "https://registry.ollama.ai/library/demo:latest",
        ),
        # A default registry with a scheme: its scheme; the store keeps the short name.
        (
            "demo:q4",
            "http://127.0.0.1:11435",
            False,
            "registry.ollama.ai/library/demo:q4",
            "http://127.0.0.1:11435/library/demo:q4",
        ),
        (
            "ns/demo",
            "https://reg.example",
            False,
            "registry.ollama.ai/ns/demo:latest",
            "https://reg.example/ns/demo:latest",
        ),
        # A loopback host without a scheme: plain http.
        (
            "demo",
            "localhost:5000",
            False,
            "registry.ollama.ai/library/demo:latest",
            "http://localhost:5000/library/demo:latest",
        ),
        (
            "127.0.0.1:5000/ns/demo",
            "",
            False,
            "127.0.0.1:5000/ns/demo:latest",
            "http://127.0.0.1:5000/ns/demo:latest",
        ),
        # Any other host: https, unless the name says http:// or insecure is set.
        (
            "reg.example:5000/ns/demo",
            "",
            False,
            "reg.example:5000/ns/demo:latest",
            "https://reg.example:5000/ns/demo:latest",
        ),
        (
            "http://reg.example/ns/demo",
            "",
            False,
            "reg.example/ns/demo:latest",
            "http://reg.example/ns/demo:latest",
        ),
        (
            "reg.example/ns/demo",
            "",
            True,
            "reg.example/ns/demo:latest",
            "http://reg.example/ns/demo:latest",
        ),
        (
            "demo",
            "reg.example",
            True,
            "registry.ollama.ai/library/demo:latest",
            "http://reg.example/library/demo:latest",
        ),
    ],
)
def test_locate(text, registry, insecure, local, url):
    name, remote = locate(text, registry, insecure)
    assert str(name) == local
    assert str(remote) == url


@pytest.mark.parametrize("text", ["", "a/b/c/d", "../x", "demo@sha256:" + "0" * 64, "ftp://h/a/b"])
def test_locate_rejects(text):
    with pytest.raises(InvalidName):
        locate(text)


def _manifest(*layers):
    config = {"mediaType": mf.CONFIG, "digest": D1, "size": 10}
    return json.dumps(
        {"schemaVersion": 2, "mediaType": mf.MANIFEST, "config": config, "layers": list(layers)}
    ).encode()


def test_compressed_layer_is_kept_uncompressed():
    zstd = {
        "mediaType": ZSTD,
        "digest": D2,
        "size": 5,
        "name": "ftw-00000.bin",
        "uncompressed_digest": D3,
        "uncompressed_size": 9,
    }
    wire = WireManifest.from_bytes(_manifest(zstd))
    assert wire.layers[0].local == mf.Layer(mf.FILE, D3, 9, "ftw-00000.bin")
    assert [b.digest for b in wire.blobs()] == [D1, D2]
    assert WireManifest.from_bytes(wire.to_bytes()) == wire


@pytest.mark.parametrize(
    "layer",
    [
        {"mediaType": mf.FILE, "digest": D2, "size": 5, "name": "../../etc/passwd"},
        {"mediaType": mf.FILE, "digest": D2, "size": 5, "name": "/abs"},
        {"mediaType": mf.FILE, "digest": D2, "size": 5},
        {"mediaType": ZSTD, "digest": D2, "size": 5, "name": "a.bin"},
        {"mediaType": mf.FILE, "digest": "sha256:xyz", "size": 5, "name": "a"},
        {"mediaType": mf.FILE, "digest": D2, "size": -1, "name": "a"},
    ],
)
def test_bad_layers_are_refused(layer):
    with pytest.raises(mf.ManifestError):
        WireManifest.from_bytes(_manifest(layer))


def test_plain_layer_round_trip():
    layer = mf.Layer(mf.TEMPLATE, D2, 5)
    assert WireLayer.of(layer).local == layer
