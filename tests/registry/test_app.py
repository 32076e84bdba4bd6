"""The registry over real HTTP on loopback: uploads, downloads, manifests, tokens."""

from __future__ import annotations

import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from freetoken.registry import app
from tests.registry.conftest import (
    MANIFEST_TYPE,
    digest_of,
    error_code,
    manifest_for,
    push_blob,
    push_model,
)

REPO = "library/demo"
# Larger than the server's 1 MiB write buffer and not a multiple of it.
DATA = os.urandom((3 << 20) + 12345)


def stored_blobs(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "blobs").iterdir())


def test_version_check(client):
    r = client.get("/v2/")
    assert r.status_code == 200 and r.json() == {}


def test_chunked_upload_and_whole_download(registry, client):
    digest = push_blob(client, REPO, DATA, chunk=1_000_003)
    r = client.head(f"/v2/{REPO}/blobs/{digest}")
    assert r.status_code == 200
    assert int(r.headers["Content-Length"]) == len(DATA)
    assert r.headers["Docker-Content-Digest"] == digest
    r = client.get(f"/v2/{REPO}/blobs/{digest}")
    assert r.status_code == 200 and r.content == DATA
    assert r.headers["Accept-Ranges"] == "bytes"
    assert stored_blobs(registry.root) == [digest.replace(":", "-")]
    assert list((registry.root / "uploads").iterdir()) == []


def test_patch_without_range_and_last_chunk_on_put(client):
    location = client.post(f"/v2/{REPO}/blobs/uploads").headers["Location"]
    r = client.patch(location, content=DATA[:100])
    assert r.status_code == 202 and r.headers["Range"] == "0-99"
    r = client.get(location)
    assert r.status_code == 204 and r.headers["Range"] == "0-99"
    r = client.put(location, params={"digest": digest_of(DATA)}, content=DATA[100:])
    assert r.status_code == 201
    assert client.get(r.headers["Location"]).content == DATA


def test_monolithic_upload(client):
    digest = digest_of(DATA)
    r = client.post(f"/v2/{REPO}/blobs/uploads/", params={"digest": digest}, content=DATA)
    assert r.status_code == 201
    assert r.headers["Location"] == f"/v2/{REPO}/blobs/{digest}"
    assert client.get(f"/v2/{REPO}/blobs/{digest}").content == DATA


def test_empty_blob(client):
    digest = push_blob(client, REPO, b"")
    r = client.get(f"/v2/{REPO}/blobs/{digest}")
    assert r.status_code == 200 and r.content == b""
    assert (
        client.get(f"/v2/{REPO}/blobs/{digest}", headers={"Range": "bytes=0-"}).status_code == 416
    )


def test_chunk_at_wrong_offset_is_refused_and_changes_nothing(client):
    location = client.post(f"/v2/{REPO}/blobs/uploads/").headers["Location"]
    client.patch(location, content=DATA[:10], headers={"Content-Range": "0-9"})
    for bad in ("0-9", "11-20", "5-14"):
        r = client.patch(location, content=DATA[:10], headers={"Content-Range": bad})
        assert r.status_code == 416 and error_code(r) == "RANGE_INVALID"
        assert r.headers["Range"] == "0-9"
    # A range that announces more bytes than the body holds is rolled back whole.
    r = client.patch(location, content=DATA[10:15], headers={"Content-Range": "10-19"})
    assert r.status_code == 400 and error_code(r) == "BLOB_UPLOAD_INVALID"
    r = client.patch(location, content=DATA[10:20], headers={"Content-Range": "10-19"})
    assert r.status_code == 202 and r.headers["Range"] == "0-19"
    r = client.put(location, params={"digest": digest_of(DATA[:20])})
    assert r.status_code == 201


def test_body_cut_short_by_the_client_is_rolled_back(registry, client):
    location = client.post(f"/v2/{REPO}/blobs/uploads/").headers["Location"]
    client.patch(location, content=b"x" * 10)

    def offset() -> int:
        return int(client.get(location).headers["Range"].split("-")[1]) + 1

    def wait_for(done) -> None:
        deadline = time.monotonic() + 5
        while not done():
            assert time.monotonic() < deadline
            time.sleep(0.01)

    with socket.create_connection(("127.0.0.1", registry.port)) as s:
        s.sendall(
            f"PATCH {location} HTTP/1.1\r\nHost: x\r\nContent-Length: {3 << 20}\r\n\r\n".encode()
        )
        s.sendall(b"y" * (3 << 19))
        wait_for(lambda: offset() > 10)  # the server has written part of the chunk
    wait_for(lambda: offset() == 10)
    r = client.put(location, params={"digest": digest_of(b"x" * 10)})
    assert r.status_code == 201


def test_ranges_are_byte_identical(client):
    digest = push_blob(client, REPO, DATA)
    url = f"/v2/{REPO}/blobs/{digest}"
    size = len(DATA)
    cases = {
        "bytes=0-0": (0, 1),
        "bytes=5-1048580": (5, 1048581),
        f"bytes={size - 7}-": (size - 7, size),
        f"bytes=100-{size + 1000}": (100, size),
        "bytes=-4096": (size - 4096, size),
        f"bytes=-{size * 2}": (0, size),
    }
    for header, (start, stop) in cases.items():
        r = client.get(url, headers={"Range": header})
        assert r.status_code == 206, header
        assert r.content == DATA[start:stop], header
        assert r.headers["Content-Range"] == f"bytes {start}-{stop - 1}/{size}"
        assert int(r.headers["Content-Length"]) == stop - start
    # The way a parallel download fetches it: fixed parts, put back together.
    part = 700_001
    pieces = [
        client.get(url, headers={"Range": f"bytes={a}-{a + part - 1}"}).content
        for a in range(0, size, part)
    ]
    assert b"".join(pieces) == DATA


def test_unsatisfiable_and_ignored_ranges(client):
    digest = push_blob(client, REPO, DATA[:1000])
    url = f"/v2/{REPO}/blobs/{digest}"
    for header in ("bytes=1000-", "bytes=5000-6000", "bytes=10-5", "bytes=-0"):
        r = client.get(url, headers={"Range": header})
        assert r.status_code == 416, header
        assert r.headers["Content-Range"] == "bytes */1000"
    # Not a single byte range: the whole blob, as RFC 9110 allows.
    for header in ("bytes=0-1,5-6", "items=0-5", "bytes=x-y"):
        r = client.get(url, headers={"Range": header})
        assert r.status_code == 200 and r.content == DATA[:1000], header
    r = client.head(url, headers={"Range": "bytes=0-9"})
    assert r.status_code == 200 and r.headers["Content-Length"] == "1000"


@pytest.mark.parametrize("monolithic", [False, True])
def test_digest_mismatch_is_rejected_and_nothing_is_stored(registry, client, monolithic):
    wrong = digest_of(b"something else")
    if monolithic:
        r = client.post(f"/v2/{REPO}/blobs/uploads/", params={"digest": wrong}, content=DATA)
    else:
        location = client.post(f"/v2/{REPO}/blobs/uploads/").headers["Location"]
        client.patch(location, content=DATA)
        r = client.put(location, params={"digest": wrong})
        assert client.patch(location, content=b"more").status_code == 404
    assert r.status_code == 400 and error_code(r) == "DIGEST_INVALID"
    assert stored_blobs(registry.root) == []
    assert list((registry.root / "uploads").iterdir()) == []
    assert client.head(f"/v2/{REPO}/blobs/{wrong}").status_code == 404


def test_finish_without_a_digest_keeps_the_upload(client):
    location = client.post(f"/v2/{REPO}/blobs/uploads/").headers["Location"]
    client.patch(location, content=b"abc")
    for params in ({}, {"digest": "sha256:abc"}, {"digest": "md5:" + "0" * 32}):
        r = client.put(location, params=params)
        assert r.status_code == 400 and error_code(r) == "DIGEST_INVALID"
    assert client.put(location, params={"digest": digest_of(b"abc")}).status_code == 201


def test_cancelled_upload_is_gone(registry, client):
    location = client.post(f"/v2/{REPO}/blobs/uploads/").headers["Location"]
    client.patch(location, content=b"abc")
    assert client.delete(location).status_code == 204
    r = client.patch(location, content=b"d")
    assert r.status_code == 404 and error_code(r) == "BLOB_UPLOAD_UNKNOWN"
    assert list((registry.root / "uploads").iterdir()) == []
    # An upload belongs to the repository that started it.
    location = client.post(f"/v2/{REPO}/blobs/uploads/").headers["Location"]
    assert client.patch(location.replace(REPO, "other/repo"), content=b"x").status_code == 404


def test_same_blob_uploaded_twice_at_once(registry):
    def upload(_: int) -> int:
        with registry.client() as c:
            location = c.post(f"/v2/{REPO}/blobs/uploads/").headers["Location"]
            c.patch(location, content=DATA)
            return c.put(location, params={"digest": digest_of(DATA)}).status_code

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(upload, range(4))) == [201] * 4
    with registry.client() as c:
        assert c.get(f"/v2/{REPO}/blobs/{digest_of(DATA)}").content == DATA
    assert len(stored_blobs(registry.root)) == 1
    assert list((registry.root / "uploads").iterdir()) == []


def test_mount(client):
    digest = push_blob(client, "other/model", b"shared bytes")
    r = client.post(f"/v2/{REPO}/blobs/uploads/", params={"mount": digest, "from": "other/model"})
    assert r.status_code == 201
    assert r.headers["Docker-Content-Digest"] == digest
    assert client.get(r.headers["Location"]).content == b"shared bytes"
    # Not here: an ordinary upload starts instead.
    r = client.post(f"/v2/{REPO}/blobs/uploads/", params={"mount": digest_of(b"x"), "from": "o/m"})
    assert r.status_code == 202 and "/blobs/uploads/" in r.headers["Location"]


def test_manifest_round_trip(client):
    manifest = push_model(client, REPO, "latest", b"weights" * 1000, b"tokenizer")
    digest = digest_of(manifest)
    url = f"/v2/{REPO}/manifests/latest"
    r = client.get(url, headers={"Accept": MANIFEST_TYPE})
    assert r.status_code == 200 and r.content == manifest
    assert r.headers["Content-Type"] == MANIFEST_TYPE
    assert r.headers["Docker-Content-Digest"] == digest
    r = client.head(url)
    assert r.status_code == 200 and int(r.headers["Content-Length"]) == len(manifest)
    assert r.headers["Docker-Content-Digest"] == digest
    assert client.get(f"/v2/{REPO}/manifests/{digest}").content == manifest
    assert client.get("/v2/Library/DEMO/manifests/LATEST").content == manifest
    r = client.get(f"/v2/{REPO}/manifests/other")
    assert r.status_code == 404 and error_code(r) == "MANIFEST_UNKNOWN"
    assert client.head(f"/v2/{REPO}/manifests/other").status_code == 404


def test_manifest_is_refused_when_a_blob_is_missing(registry, client):
    config, layer = b'{"model_format": "ftw"}', b"layer bytes"
    push_blob(client, REPO, config)
    url = f"/v2/{REPO}/manifests/latest"
    r = client.put(url, content=manifest_for(config, layer))
    assert r.status_code == 400 and error_code(r) == "MANIFEST_BLOB_UNKNOWN"
    assert r.json()["errors"][0]["detail"] == {"digest": digest_of(layer)}
    r = client.put(url, content=manifest_for(b"absent config"))
    assert r.status_code == 400 and error_code(r) == "MANIFEST_BLOB_UNKNOWN"
    assert client.get(url).status_code == 404
    assert client.get("/v2/_catalog").json() == {"repositories": []}
    assert list((registry.root / "manifests").rglob("*")) == []


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"[]",
        b'{"schemaVersion": 1}',
        b'{"schemaVersion": 2}',
        b'{"schemaVersion": 2, "config": {"mediaType": "x", "digest": "sha256:zz", "size": 1}}',
        b'{"schemaVersion": 2, "config": {"mediaType": "x"}}',
    ],
)
def test_malformed_manifest_is_refused(client, body):
    r = client.put(f"/v2/{REPO}/manifests/latest", content=body)
    assert r.status_code == 400 and error_code(r) == "MANIFEST_INVALID"


def test_manifest_with_wrong_sizes_or_too_big_is_refused(client):
    config = b"{}"
    push_blob(client, REPO, config)
    body = manifest_for(config).replace(b'"size": 2', b'"size": 3')
    r = client.put(f"/v2/{REPO}/manifests/latest", content=body)
    assert r.status_code == 400 and error_code(r) == "MANIFEST_INVALID"
    r = client.put(f"/v2/{REPO}/manifests/latest", content=b" " * (5 << 20))
    assert r.status_code == 413


def test_catalog_and_tags(client):
    assert client.get("/v2/_catalog").json() == {"repositories": []}
    push_model(client, REPO, "latest", b"a")
    push_model(client, REPO, "7b", b"b")
    push_model(client, "someone/tiny", "v1", b"c")
    assert client.get("/v2/_catalog").json() == {"repositories": ["library/demo", "someone/tiny"]}
    assert client.get(f"/v2/{REPO}/tags/list").json() == {"name": REPO, "tags": ["7b", "latest"]}
    r = client.get("/v2/library/nothing/tags/list")
    assert r.status_code == 404 and error_code(r) == "NAME_UNKNOWN"


def test_retag_with_other_case_replaces_the_tag(client):
    push_model(client, REPO, "Latest", b"old")
    new = push_model(client, "Library/Demo", "latest", b"new")
    assert client.get(f"/v2/{REPO}/tags/list").json() == {"name": REPO, "tags": ["latest"]}
    assert client.get(f"/v2/{REPO}/manifests/LATEST").content == new
    assert client.get("/v2/_catalog").json() == {"repositories": [REPO]}


def test_token_guards_writes_only(registry, tmp_path):
    reg = registry.serve(tmp_path / "guarded", token="s3cret")
    with reg.client() as anon, reg.client("wrong") as wrong, reg.client("s3cret") as ok:
        manifest = push_model(ok, REPO, "latest", b"weights")
        digest = digest_of(b"weights")
        # Reads are open.
        assert anon.get("/v2/").status_code == 200
        assert anon.get(f"/v2/{REPO}/manifests/latest").content == manifest
        assert anon.get(f"/v2/{REPO}/blobs/{digest}").content == b"weights"
        assert anon.head(f"/v2/{REPO}/blobs/{digest}").status_code == 200
        assert anon.get("/v2/_catalog").json() == {"repositories": [REPO]}
        assert anon.get(f"/v2/{REPO}/tags/list").status_code == 200
        location = ok.post(f"/v2/{REPO}/blobs/uploads/").headers["Location"]
        writes = [
            ("POST", f"/v2/{REPO}/blobs/uploads/", {}),
            ("POST", f"/v2/{REPO}/blobs/uploads/", {"digest": digest_of(b"x")}),
            ("POST", f"/v2/{REPO}/blobs/uploads/", {"mount": digest, "from": REPO}),
            ("PATCH", location, {}),
            ("PUT", location, {"digest": digest_of(b"")}),
            ("DELETE", location, {}),
            ("PUT", f"/v2/{REPO}/manifests/latest", {}),
        ]
        for c in (anon, wrong):
            for method, url, params in writes:
                r = c.request(method, url, params=params, content=b"x")
                assert r.status_code == 401, (method, url)
                assert error_code(r) == "UNAUTHORIZED"
                assert r.headers["WWW-Authenticate"] == 'Bearer realm="freetoken"'
        # None of the refused writes changed anything.
        assert ok.get(location).headers["Range"] == "0-0"
        assert ok.put(location, params={"digest": digest_of(b"")}).status_code == 201
        assert anon.get(f"/v2/{REPO}/manifests/latest").content == manifest


def test_unknown_things_answer_oci_errors(client):
    missing = digest_of(b"missing")
    r = client.get(f"/v2/{REPO}/blobs/{missing}")
    assert r.status_code == 404 and error_code(r) == "BLOB_UNKNOWN"
    assert client.head(f"/v2/{REPO}/blobs/{missing}").status_code == 404
    r = client.get("/v2/not/a/route/at/all")
    assert r.status_code == 404 and "errors" in r.json()
    r = client.delete(f"/v2/{REPO}/manifests/latest")
    assert r.status_code == 405 and "errors" in r.json()
    r = client.patch(f"/v2/{REPO}/blobs/uploads/{'0' * 32}", content=b"x")
    assert r.status_code == 404 and error_code(r) == "BLOB_UPLOAD_UNKNOWN"


def test_stale_uploads_are_dropped_at_start(registry, tmp_path):
    root = tmp_path / "root"
    (root / "uploads" / "leftover-dir").mkdir(parents=True)
    (root / "uploads" / "0123").write_bytes(b"half")
    (root / "manifests" / "library" / "demo").mkdir(parents=True)
    (root / "manifests" / "library" / "demo" / ".partial-x").write_bytes(b"{")
    with registry.serve(root).client() as c:
        assert list((root / "uploads").iterdir()) == []
        assert c.get("/v2/_catalog").json() == {"repositories": []}


def test_blobs_are_read_in_bounded_chunks(tmp_path):
    path = tmp_path / "blob"
    path.write_bytes(DATA)
    chunks = list(app._read_file(path, 10, len(DATA) - 10))
    assert max(map(len, chunks)) <= 1 << 20
    assert b"".join(chunks) == DATA[10:-10]
