import httpx
import pytest

from freetoken.cli.client import Client
from freetoken.cli.errors import NotRunning, ServerError

from .conftest import error, ndjson


def test_json_error_body_becomes_server_error_with_status(api, client):
    api.on("POST", "/api/show", error(404, "model 'x' not found"))
    with pytest.raises(ServerError) as e:
        client.call("POST", "/api/show", {"model": "x"})
    assert str(e.value) == "model 'x' not found"
    assert e.value.status == 404


def test_plain_text_error_body(api, client):
    api.on("GET", "/api/tags", httpx.Response(500, text="boom"))
    with pytest.raises(ServerError, match="boom"):
        client.call("GET", "/api/tags")


def test_empty_body_is_none(api, client):
    api.on("POST", "/api/copy", httpx.Response(200))
    assert client.call("POST", "/api/copy", {"source": "a", "destination": "b"}) is None


def test_stream_yields_objects_and_raises_on_an_error_line(api, client):
    api.on("POST", "/api/pull", ndjson({"status": "pulling manifest"}, {"error": "registry down"}))
    seen = []
    with pytest.raises(ServerError, match="registry down"):
        for obj in client.stream("/api/pull", {"model": "m"}):
            seen.append(obj)
    assert seen == [{"status": "pulling manifest"}]


def test_stream_error_status_before_streaming(api, client):
    api.on("POST", "/api/generate", error(400, "bad think value"))
    with pytest.raises(ServerError) as e:
        list(client.stream("/api/generate", {}))
    assert e.value.status == 400


def test_connection_refused_is_not_running():
    def refuse(request):
        raise httpx.ConnectError("refused", request=request)

    c = Client("http://127.0.0.1:9", transport=httpx.MockTransport(refuse))
    with pytest.raises(NotRunning, match=r"http://127.0.0.1:9.*freetoken serve"):
        c.heartbeat()
    with pytest.raises(NotRunning):
        list(c.stream("/api/chat", {}))


def test_blob_exists_and_upload(api, client, tmp_path):
    f = tmp_path / "w.bin"
    f.write_bytes(b"x" * (3 << 20))
    api.on("HEAD", "/api/blobs/sha256:aa", httpx.Response(404, json={"error": "not found"}))
    api.on("HEAD", "/api/blobs/sha256:bb", httpx.Response(200))
    api.on("POST", "/api/blobs/sha256:aa", httpx.Response(201))
    assert not client.blob_exists("sha256:aa")
    assert client.blob_exists("sha256:bb")
    sent = []
    client.upload_blob("sha256:aa", f, sent.append)
    upload = api.requests[-1]
    assert upload.headers["content-length"] == str(3 << 20)
    assert "transfer-encoding" not in upload.headers
    assert upload.content == f.read_bytes()
    assert sent[-1] == 3 << 20


def test_default_address_comes_from_settings(monkeypatch):
    from freetoken import config

    monkeypatch.setenv("FREETOKEN_HOST", "0.0.0.0:4321")
    config.current.cache_clear()
    try:
        assert Client().base_url == "http://127.0.0.1:4321"
    finally:
        config.current.cache_clear()
