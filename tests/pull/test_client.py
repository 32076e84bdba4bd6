"""The registry client against httpx.MockTransport: error messages and range checks."""

import httpx
import pytest

from freetoken.pull.client import RegistryClient, RegistryError, TransientError

D = "sha256:" + "a" * 64


def client(handler, token=""):
    return RegistryClient("http://reg.test", token, transport=httpx.MockTransport(handler))


def test_unknown_manifest_is_ollamas_message():
    c = client(lambda r: httpx.Response(404, json={"errors": [{"code": "MANIFEST_UNKNOWN"}]}))
    with pytest.raises(RegistryError) as e:
        c.manifest("library/nope", "latest")
    assert str(e.value) == "pull model manifest: file does not exist"
    assert e.value.status == 404


@pytest.mark.parametrize(
    "token, says",
    [
        ("", "set FREETOKEN_REGISTRY_TOKEN"),
        ("wrong", "rejected the token in FREETOKEN_REGISTRY_TOKEN"),
    ],
)
def test_unauthorized_names_the_setting(token, says):
    seen = []

    def handler(r):
        seen.append(r.headers.get("authorization"))
        return httpx.Response(401, json={"errors": [{"code": "UNAUTHORIZED"}]})

    with pytest.raises(RegistryError) as e:
        client(handler, token).start_upload("library/demo")
    assert says in str(e.value) and e.value.status == 401
    assert seen == [f"Bearer {token}" if token else None]


def test_server_errors_are_transient_and_client_errors_are_not():
    c = client(lambda r: httpx.Response(503, text="busy"))
    with pytest.raises(TransientError):
        c.has_blob("library/demo", D)
    body = {"errors": [{"code": "DIGEST_INVALID", "message": "no"}]}
    c = client(lambda r: httpx.Response(400, json=body))
    with pytest.raises(RegistryError) as e:
        c.finish_upload("/v2/library/demo/blobs/uploads/1", D)
    assert not isinstance(e.value, TransientError)
    assert "DIGEST_INVALID: no" in str(e.value)


def test_connection_refused_is_transient():
    def handler(r):
        raise httpx.ConnectError("refused")

    with pytest.raises(TransientError):
        client(handler).manifest("library/demo", "latest")


def test_a_range_must_be_honoured():
    def whole(r):
        return httpx.Response(200, content=b"0123456789")

    with pytest.raises(RegistryError, match="ignored a Range"):
        with client(whole).blob_range("library/demo", D, 4, 8):
            pass
    with client(whole).blob_range("library/demo", D, 0, 10) as r:
        assert r.read() == b"0123456789"

    def wrong(r):
        return httpx.Response(206, content=b"0123", headers={"Content-Range": "bytes 0-3/10"})

    with pytest.raises(RegistryError, match="Content-Range"):
        with client(wrong).blob_range("library/demo", D, 4, 8):
            pass


def test_upload_locations_are_followed():
    calls = []

    def handler(r):
        calls.append((r.method, str(r.url)))
        if r.method == "POST":
            return httpx.Response(202, headers={"Location": "/v2/library/demo/blobs/uploads/u1"})
        if r.method == "PATCH":
            return httpx.Response(202, headers={"Location": "/v2/library/demo/blobs/uploads/u2"})
        return httpx.Response(201)

    c = client(handler)
    loc = c.start_upload("library/demo")
    loc = c.upload_chunk(loc, [b"abc"], 0, 3)
    c.finish_upload(loc, D)
    assert calls == [
        ("POST", "http://reg.test/v2/library/demo/blobs/uploads/"),
        ("PATCH", "http://reg.test/v2/library/demo/blobs/uploads/u1"),
        ("PUT", f"http://reg.test/v2/library/demo/blobs/uploads/u2?digest={D.replace(':', '%3A')}"),
    ]
