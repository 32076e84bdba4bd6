"""CORS and the DNS-rebinding (Host header) guard, on the app and on a real server."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import httpx
import ollama
import pytest
from starlette.testclient import TestClient

from freetoken.api.middleware import (
    ALLOWED_HEADERS,
    host_allowed,
    is_loopback_bind,
    origin_pattern,
)
from tests.server.harness import LiveServer, local_client, make_config


@pytest.fixture
def app_client(tmp_path) -> Iterator[TestClient]:
    """The app as `freetoken serve` builds it with default settings (bound to loopback)."""
    with local_client(make_config(tmp_path)) as c:
        yield c


def _client(tmp_path, **env: str) -> TestClient:
    return local_client(make_config(tmp_path, **env))


# -- CORS --------------------------------------------------------------------------------

ALLOWED = [
    "http://localhost",
    "https://localhost",
    "http://localhost:3000",
    "https://localhost:8443",
    "http://127.0.0.1",
    "http://127.0.0.1:5173",
    "https://127.0.0.1:1",
    "http://0.0.0.0",
    "http://0.0.0.0:8080",
    "app://obsidian.md",
    "file://",
    "tauri://localhost",
    "vscode-webview://1n2b3c4d",
    "vscode-file://vscode-app",
]

DENIED = [
    "https://evil.example",
    "http://localhost.evil.example",
    "http://127.0.0.1.nip.io",
    "http://localhost:3000.evil.example",
    "http://192.168.1.20:3000",
    "chrome-extension://abcdef",
    "null",
]


@pytest.mark.parametrize("origin", ALLOWED)
def test_preflight_from_an_allowed_origin_is_204(app_client, origin):
    r = app_client.options(
        "/api/chat",
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type,authorization,x-stainless-os",
        },
    )
    assert r.status_code == 204
    assert r.content == b""
    assert r.headers["access-control-allow-origin"] == origin
    assert "Origin" in r.headers["vary"]
    methods = {m.strip() for m in r.headers["access-control-allow-methods"].split(",")}
    assert {"GET", "POST", "DELETE", "HEAD", "OPTIONS"} <= methods
    allowed = {h.strip().lower() for h in r.headers["access-control-allow-headers"].split(",")}
    want = {
        "authorization",
        "content-type",
        "user-agent",
        "accept",
        "x-requested-with",
        "openai-beta",
        "x-stainless-os",
        "x-stainless-lang",
        "x-stainless-arch",
        "x-stainless-runtime",
        "x-stainless-runtime-version",
        "x-stainless-package-version",
        "x-stainless-retry-count",
        "x-stainless-timeout",
    }
    assert want <= allowed
    assert int(r.headers["access-control-max-age"]) > 0


@pytest.mark.parametrize("origin", ALLOWED)
def test_responses_to_allowed_origins_carry_cors_headers(app_client, origin):
    r = app_client.get("/api/version", headers={"Origin": origin})
    assert r.status_code == 200 and "version" in r.json()
    assert r.headers["access-control-allow-origin"] == origin


@pytest.mark.parametrize("origin", DENIED)
def test_requests_from_other_origins_are_403(app_client, origin):
    # Not just a response the browser hides: the request never reaches a route, so a foreign
    # page cannot even send a "simple" POST that pulls or creates a model.
    assert app_client.get("/api/tags", headers={"Origin": origin}).status_code == 403
    r = app_client.post(
        "/api/pull",
        headers={"Origin": origin, "Content-Type": "text/plain"},
        content=b'{"model": "x"}',
    )
    assert r.status_code == 403
    r = app_client.options(
        "/api/chat", headers={"Origin": origin, "Access-Control-Request-Method": "POST"}
    )
    assert r.status_code == 403
    assert "access-control-allow-origin" not in r.headers


def test_without_an_origin_there_are_no_cors_headers(app_client):
    r = app_client.get("/api/tags")
    assert r.status_code == 200
    assert "access-control-allow-origin" not in r.headers


def test_error_responses_carry_cors_headers_too(app_client):
    # A browser client must be able to read the error message, not just see a CORS failure.
    r = app_client.post(
        "/api/show", json={"model": "nope"}, headers={"Origin": "http://localhost:3000"}
    )
    assert r.status_code == 404 and r.json() == {"error": "model 'nope' not found"}
    assert r.headers["access-control-allow-origin"] == "http://localhost:3000"
    r = app_client.get("/no/such/route", headers={"Origin": "http://localhost:3000"})
    assert r.status_code == 404
    assert r.headers["access-control-allow-origin"] == "http://localhost:3000"


def test_a_same_origin_request_passes_without_cors(tmp_path):
    # Bound to all interfaces and called by its LAN address from a page it serves itself.
    with _client(tmp_path, FREETOKEN_HOST="0.0.0.0:11434") as c:
        r = c.get(
            "/api/version",
            headers={"Host": "192.168.1.20:11434", "Origin": "http://192.168.1.20:11434"},
        )
    assert r.status_code == 200
    assert "access-control-allow-origin" not in r.headers


@pytest.mark.parametrize("var", ["FREETOKEN_ORIGINS", "OLLAMA_ORIGINS"])
def test_origins_setting_adds_origins_and_wildcards(tmp_path, var):
    env = {var: "https://chat.example.com, chrome-extension://*,http://*.corp.example"}
    with _client(tmp_path, **env) as c:
        for origin in (
            "https://chat.example.com",
            "chrome-extension://abcdef",
            "http://ui.corp.example",
            "http://localhost:3000",
        ):
            r = c.get("/api/version", headers={"Origin": origin})
            assert r.status_code == 200, origin
            assert r.headers["access-control-allow-origin"] == origin
        for origin in (
            "https://evil.example",
            "http://chat.example.com",
            "https://ui.corp.example",
        ):
            assert c.get("/api/version", headers={"Origin": origin}).status_code == 403, origin


def test_origins_star_allows_every_origin(tmp_path):
    with _client(tmp_path, OLLAMA_ORIGINS="*") as c:
        r = c.get("/api/version", headers={"Origin": "https://anything.example"})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "https://anything.example"


def test_origin_pattern():
    p = origin_pattern(["http://localhost:*", "app://*", "https://a.example"])
    assert p.fullmatch("http://localhost:8080") and p.fullmatch("APP://x")
    assert p.fullmatch("https://a.example")
    assert not p.fullmatch("https://a.example.evil") and not p.fullmatch("http://localhost")
    assert not p.fullmatch("http://localhost:1.evil.example")  # a trailing :* is a port
    assert origin_pattern(["*"]).fullmatch("https://x.example")
    assert not origin_pattern([]).fullmatch("http://localhost")


def test_allowed_headers_name_the_sdk_headers():
    names = {h.lower() for h in ALLOWED_HEADERS}
    assert {"authorization", "openai-beta", "x-stainless-lang", "x-requested-with"} <= names


# -- the Host-header guard ----------------------------------------------------------------

HOSTS_ALLOWED = [
    "127.0.0.1:11434",
    "127.0.0.1",
    "127.1.2.3:80",
    "localhost:11434",
    "LOCALHOST",
    "localhost.",
    "[::1]:11434",
    "[::1]",
    "::1",
    "0.0.0.0:11434",
    "[::]:11434",
    "10.0.0.5:11434",
    "172.16.3.4",
    "192.168.1.20:11434",
    "[fd00::1]:11434",
    "app.localhost:3000",
    "printer.local",
    "ollama.internal:11434",
    "myhost",
    "MyHost:11434",
    "",
]

HOSTS_DENIED = [
    "evil.example",
    "evil.example:11434",
    "localhost.evil.example",
    "127.0.0.1.nip.io",
    "8.8.8.8:11434",
    "[2606:4700::1111]:11434",
    "local",
    "otherhost",
    "internal.example",
    "testserver",
]


@pytest.mark.parametrize("host", HOSTS_ALLOWED)
def test_host_allowed(host):
    assert host_allowed(host, "myhost")


@pytest.mark.parametrize("host", HOSTS_DENIED)
def test_host_denied(host):
    assert not host_allowed(host, "myhost")


def test_missing_host_header_is_allowed():
    assert host_allowed(None, "myhost")


@pytest.mark.parametrize(
    "bind, loopback",
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("", False),
        ("192.168.1.20", False),
        ("10.1.2.3", False),
    ],
)
def test_is_loopback_bind(bind, loopback):
    assert is_loopback_bind(bind) is loopback


@pytest.mark.parametrize("host", ["evil.example:11434", "8.8.8.8", "otherhost.example"])
def test_guarded_app_refuses_foreign_hosts(app_client, host):
    r = app_client.get("/api/tags", headers={"Host": host})
    assert r.status_code == 403
    # before CORS: a rebinding page gets no preflight answer either
    r = app_client.options(
        "/api/tags",
        headers={
            "Host": host,
            "Origin": "http://localhost:3000",
            "Access-Control-Request-Method": "GET",
        },
    )
    assert r.status_code == 403


@pytest.mark.parametrize(
    "host", ["localhost:11434", "[::1]:11434", "foo.localhost", "192.168.0.9:11434"]
)
def test_guarded_app_serves_local_hosts(app_client, host):
    assert app_client.get("/api/tags", headers={"Host": host}).status_code == 200


def test_guarded_app_serves_this_machines_hostname(app_client):
    host = socket.gethostname()
    assert app_client.get("/api/tags", headers={"Host": f"{host}:11434"}).status_code == 200


@pytest.mark.parametrize("bind", ["0.0.0.0:11434", "192.168.1.20:11434"])
def test_no_guard_when_not_bound_to_loopback(tmp_path, bind):
    with _client(tmp_path, FREETOKEN_HOST=bind) as c:
        assert c.get("/api/tags", headers={"Host": "models.example.com"}).status_code == 200


def test_guard_when_bound_to_localhost_by_name(tmp_path):
    with _client(tmp_path, OLLAMA_HOST="localhost:11434") as c:
        assert c.get("/api/tags", headers={"Host": "evil.example"}).status_code == 403


# -- Authorization is ignored ---------------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [
        {"Authorization": "Bearer ollama-local"},
        {"Authorization": "Basic Zm9vOmJhcg=="},
        {"x-api-key": "sk-ant-whatever", "anthropic-version": "2023-06-01"},
    ],
)
def test_authorization_headers_are_ignored(app_client, headers):
    assert app_client.get("/api/tags", headers=headers).json() == {"models": []}
    assert app_client.get("/v1/models", headers=headers).json() == {"object": "list", "data": []}


# -- on a real server over loopback -------------------------------------------------------------


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> Iterator[LiveServer]:
    with LiveServer(make_config(tmp_path_factory.mktemp("models"))) as srv:
        yield srv


def test_real_server_guard_and_cors(live):
    with httpx.Client(base_url=live.url, timeout=10) as c:
        assert c.get("/").text == "Ollama is running"
        assert c.get("/", headers={"Host": "evil.example"}).status_code == 403
        assert c.get("/", headers={"Host": f"localhost:{live.port}"}).status_code == 200
        r = c.options(
            "/v1/chat/completions",
            headers={
                "Origin": "vscode-webview://abc",
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization,content-type,openai-beta",
            },
        )
        assert r.status_code == 204
        assert r.headers["access-control-allow-origin"] == "vscode-webview://abc"
        assert c.get("/api/tags", headers={"Origin": "https://evil.example"}).status_code == 403


def test_real_clients_with_api_keys_are_served(live):
    # ollama-python sends OLLAMA_API_KEY as a bearer token; OpenClaw sends "ollama-local".
    client = ollama.Client(host=live.url, headers={"Authorization": "Bearer ollama-local"})
    assert client.list().models == []
    import openai

    oai = openai.OpenAI(base_url=f"{live.url}/v1", api_key="sk-anything")
    assert list(oai.models.list()) == []
