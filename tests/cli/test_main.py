"""The verbs through `main`, against a scripted server (output, requests and exit codes)."""

import subprocess
import sys
from datetime import UTC, datetime, timedelta

import httpx

import freetoken
from freetoken.cli.client import Client
from freetoken.cli.main import main

from .conftest import error, ndjson
from .test_show import RESP


def ago(**kw) -> str:
    return (datetime.now(UTC) - timedelta(**kw)).isoformat()


def later(**kw) -> str:
    return (datetime.now(UTC) + timedelta(**kw)).isoformat()


def test_every_command_checks_the_server_first(api, client, capsys):
    api.on("GET", "/api/tags", httpx.Response(200, json={"models": []}))
    assert main(["list"], client=client) == 0
    assert api.paths() == ["HEAD /", "GET /api/tags"]


def test_not_running(capsys):
    def refuse(request):
        raise httpx.ConnectError("refused", request=request)

    c = Client("http://127.0.0.1:1", transport=httpx.MockTransport(refuse))
    assert main(["ps"], client=c) == 1
    err = capsys.readouterr().err
    assert err.startswith("Error: could not connect to the FreeToken server at http://127.0.0.1:1")


def test_list_table(api, client, capsys):
    api.on(
        "GET",
        "/api/tags",
        httpx.Response(
            200,
            json={
                "models": [
                    {
                        "name": "demo:latest",
                        "model": "demo:latest",
                        "size": 1_234_000_000,
                        "digest": "0123456789abcdef" * 4,
                        "modified_at": ago(minutes=2, seconds=3),
                    },
                    {
                        "name": "tiny:q8",
                        "size": 767_000,
                        "digest": "f" * 64,
                        "modified_at": ago(days=3, hours=1),
                    },
                ]
            },
        ),
    )
    assert main(["ls"], client=client) == 0
    assert capsys.readouterr().out.splitlines() == [
        "NAME           ID              SIZE      MODIFIED",
        "demo:latest    0123456789ab    1.2 GB    2 minutes ago",
        "tiny:q8        ffffffffffff    767 KB    3 days ago",
    ]


def test_ps_table(api, client, capsys):
    api.on(
        "GET",
        "/api/ps",
        httpx.Response(
            200,
            json={
                "models": [
                    {
                        "name": "a:latest",
                        "digest": "a" * 64,
                        "size": 10_000_000_000,
                        "size_vram": 5_200_000_000,
                        "context_length": 4096,
                        "expires_at": later(minutes=4, seconds=30),
                    },
                    {
                        "name": "b:latest",
                        "digest": "b" * 64,
                        "size": 2_000_000_000,
                        "size_vram": 0,
                        "context_length": 8192,
                        "expires_at": "2318-01-01T00:00:00Z",
                    },
                ]
            },
        ),
    )
    assert main(["ps"], client=client) == 0
    assert capsys.readouterr().out.splitlines() == [
        "NAME        ID              SIZE     PROCESSOR          CONTEXT    UNTIL",
        "a:latest    aaaaaaaaaaaa    10 GB    48%/52% CPU/GPU    4096       4 minutes from now",
        "b:latest    bbbbbbbbbbbb    2 GB     100% CPU           8192       Forever",
    ]


def test_show_default_and_fields(api, client, capsys):
    api.on("POST", "/api/show", httpx.Response(200, json=RESP))
    assert main(["show", "demo"], client=client) == 0
    assert "    experts used        8\n" in capsys.readouterr().out
    assert main(["show", "demo", "--modelfile"], client=client) == 0
    assert capsys.readouterr().out == RESP["modelfile"]
    assert main(["show", "demo", "-v"], client=client) == 0
    assert api.bodies("POST", "/api/show")[-1] == {"model": "demo", "verbose": True}
    assert main(["show", "demo", "--license", "--system"], client=client) == 1
    assert "only one of" in capsys.readouterr().err


def test_show_missing_model(api, client, capsys):
    api.on("POST", "/api/show", error(404, "model 'nope' not found"))
    assert main(["show", "nope"], client=client) == 1
    assert capsys.readouterr().err == "Error: model 'nope' not found\n"


def test_cp_rm_stop(api, client, capsys):
    api.on("POST", "/api/copy", httpx.Response(200))
    api.on("DELETE", "/api/delete", httpx.Response(200))
    api.on("GET", "/api/ps", httpx.Response(200, json={"models": [{"name": "a:latest"}]}))
    api.on("POST", "/api/generate", ndjson({"response": "", "done": True, "done_reason": "unload"}))
    assert main(["cp", "a", "b"], client=client) == 0
    assert main(["rm", "a", "b"], client=client) == 0
    assert main(["stop", "b"], client=client) == 0
    assert capsys.readouterr().out == "copied 'a' to 'b'\ndeleted 'a'\ndeleted 'b'\n"
    assert api.bodies("POST", "/api/copy") == [{"source": "a", "destination": "b"}]
    assert api.bodies("DELETE", "/api/delete") == [{"model": "a"}, {"model": "b"}]
    # `a` was loaded, so rm stopped it first; `stop b` is the other unload.
    assert api.bodies("POST", "/api/generate") == [
        {"model": "a", "keep_alive": 0},
        {"model": "b", "keep_alive": 0},
    ]


def test_stop_unknown_model(api, client, capsys):
    api.on("POST", "/api/generate", error(404, "model 'x' not found"))
    assert main(["stop", "x"], client=client) == 1
    assert capsys.readouterr().err == 'Error: couldn\'t find model "x" to stop\n'


def test_pull_progress_and_error(api, client, capsys):
    api.on(
        "POST",
        "/api/pull",
        ndjson(
            {"status": "pulling manifest"},
            {
                "status": "pulling 0123456789ab",
                "digest": "sha256:0123",
                "total": 2000,
                "completed": 2000,
            },
            {"status": "verifying sha256 digest"},
            {"status": "writing manifest"},
            {"status": "success"},
        ),
    )
    assert main(["pull", "demo", "--insecure"], client=client) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "pulling manifest" and err[-1] == "success"
    assert err[1].startswith("pulling 0123456789ab: 100%")
    assert api.bodies("POST", "/api/pull") == [{"model": "demo", "stream": True, "insecure": True}]
    api.on(
        "POST", "/api/push", ndjson({"status": "retrieving manifest"}, {"error": "unauthorized"})
    )
    assert main(["push", "me/demo"], client=client) == 1
    assert capsys.readouterr().err.endswith("Error: unauthorized\n")


def test_push_needs_a_namespace(api, client, capsys):
    assert main(["push", "demo"], client=client) == 1
    err = capsys.readouterr().err
    assert (
        err.startswith("Error: push needs a namespace") and "freetoken cp demo YOURNAME/demo" in err
    )
    assert api.bodies("POST", "/api/push") == []


def test_pull_names_the_shells_registry(api, client, capsys, monkeypatch):
    from freetoken.cli import commands

    monkeypatch.setattr(commands, "_registry", lambda: "http://127.0.0.1:9")
    api.on(
        "POST",
        "/api/pull",
        ndjson(
            {"status": "pulling manifest", "registry": "http://127.0.0.1:9"}, {"status": "success"}
        ),
    )
    assert main(["pull", "demo"], client=client) == 0
    assert api.bodies("POST", "/api/pull") == [
        {"model": "demo", "stream": True, "registry": "http://127.0.0.1:9"}
    ]
    assert capsys.readouterr().err.startswith("pulling manifest (http://127.0.0.1:9)")


def test_run_without_a_model_asks_for_the_model(capsys):
    assert_exit = None
    try:
        main(["run"])
    except SystemExit as e:
        assert_exit = e.code
    assert assert_exit == 2
    err = capsys.readouterr().err
    assert (
        "the following arguments are required: model" in err
        and "prompt" not in err.splitlines()[-1]
    )


def test_help_of_serve_and_bench_describe_them(capsys):
    for argv in (["serve", "--help"], ["bench", "--help"]):
        try:
            main(argv)
        except SystemExit:
            pass
    out = capsys.readouterr().out
    assert "FREETOKEN_HOST (OLLAMA_HOST)" in out and "(default 127.0.0.1:11434)" in out
    assert "FREETOKEN_MODELS (OLLAMA_MODELS)" in out
    assert "bw " in out and "B_P" in out


def test_version(api, client, capsys):
    api.on("GET", "/api/version", httpx.Response(200, json={"version": freetoken.OLLAMA_VERSION}))
    assert main(["-v"], client=client) == 0
    captured = capsys.readouterr()
    assert (
        captured.out
        == f"freetoken version is {freetoken.__version__} (Ollama API {freetoken.OLLAMA_VERSION})\n"
    )
    assert captured.err == ""
    api.on("GET", "/api/version", httpx.Response(200, json={"version": "0.0.1"}))
    assert main(["--version"], client=client) == 0
    assert "Warning: the server reports version 0.0.1" in capsys.readouterr().err


def test_version_without_a_server(capsys):
    def refuse(request):
        raise httpx.ConnectError("refused", request=request)

    c = Client("http://127.0.0.1:1", transport=httpx.MockTransport(refuse))
    assert main(["-v"], client=c) == 0
    captured = capsys.readouterr()
    assert "Warning: could not connect" in captured.err
    assert captured.out.startswith("freetoken version is")


def test_serve_reports_a_bad_setting(monkeypatch, capsys):
    from freetoken import config

    monkeypatch.setenv("FREETOKEN_HOST", "localhost:99999")
    config.current.cache_clear()
    import freetoken.server as server_pkg

    def serve():
        config.current()

    monkeypatch.setattr(server_pkg, "serve", serve, raising=False)
    try:
        assert main(["serve"]) == 1
    finally:
        config.current.cache_clear()
    assert "FREETOKEN_HOST" in capsys.readouterr().err


def test_bad_setting_for_a_client_command(monkeypatch, capsys):
    from freetoken import config

    monkeypatch.setenv("FREETOKEN_HOST", "http://x:0")
    config.current.cache_clear()
    try:
        assert main(["list"]) == 1
    finally:
        config.current.cache_clear()
    assert "Error: FREETOKEN_HOST=" in capsys.readouterr().err


def test_no_arguments_prints_help(capsys):
    assert main([]) == 0
    assert "serve" in capsys.readouterr().out


def test_startup_imports_neither_torch_nor_the_server():
    code = (
        "import sys, freetoken.cli.main, freetoken.cli.run\n"
        "heavy = ('torch', 'freetoken.server', 'freetoken.api', 'freetoken.runtime')\n"
        "print([m for m in sys.modules if m.startswith(heavy)])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_python_dash_m_freetoken():
    out = subprocess.run(
        [sys.executable, "-m", "freetoken", "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0 and "usage: freetoken" in out.stdout
