import io

import httpx
import pytest

from freetoken.cli.errors import CommandError
from freetoken.cli.main import build_parser, main, parse
from freetoken.cli.run import cmd_run, session_from_args

from .conftest import error, ndjson


class Pipe(io.StringIO):
    def isatty(self):
        return False


def run_args(*argv):
    return parse(build_parser(), ["run", *argv])


def generate_answer(*pieces, thinking=()):
    chunks = [{"response": "", "thinking": t, "done": False} for t in thinking]
    chunks += [{"response": p, "done": False} for p in pieces]
    chunks.append(
        {
            "response": "",
            "done": True,
            "done_reason": "stop",
            "total_duration": 1_500_000_000,
            "load_duration": 0,
            "prompt_eval_count": 3,
            "prompt_eval_duration": 30_000_000,
            "eval_count": 2,
            "eval_duration": 20_000_000,
        }
    )
    return ndjson(*chunks)


def answering(response):
    """/api/generate as the server answers it: a bare {model} loads; a prompt gets `response`."""
    import json

    def handle(request):
        if "prompt" not in json.loads(request.content):
            return ndjson({"model": "m", "response": "", "done": True, "done_reason": "load"})
        return response() if callable(response) else response

    return handle


def prompted(api, path="/api/generate"):
    return [b for b in api.bodies("POST", path) if "prompt" in b]


@pytest.fixture
def served(api):
    api.on(
        "POST",
        "/api/show",
        httpx.Response(200, json={"model_info": {}, "capabilities": ["completion"]}),
    )
    api.on("POST", "/api/generate", answering(lambda: generate_answer("Hello", " there")))
    return api


def test_one_shot_prompt(served, client):
    out, err = Pipe(), Pipe()
    args = run_args("demo", "say", "hi", "--keepalive", "10m", "--format", "json")
    assert cmd_run(args, client, stdin=Pipe(""), out=out, err=err) == 0
    assert out.getvalue() == "Hello there\n"
    assert err.getvalue() == ""
    assert served.bodies("POST", "/api/generate") == [
        {"model": "demo", "keep_alive": "10m"},  # loaded first, as Ollama's CLI does
        {
            "model": "demo",
            "prompt": "say hi",
            "stream": True,
            "format": "json",
            "keep_alive": "10m",
        },
    ]


def test_piped_stdin_comes_before_the_prompt_words(served, client):
    args = run_args("demo", "summarize")
    cmd_run(args, client, stdin=Pipe("some text\n"), out=Pipe(), err=Pipe())
    assert prompted(served)[0]["prompt"] == "some text\n summarize"


def test_verbose_prints_the_stats_block_to_stderr(served, client):
    err = Pipe()
    cmd_run(run_args("demo", "hi", "--verbose"), client, stdin=Pipe(""), out=Pipe(), err=err)
    labels = [line.split(":")[0] for line in err.getvalue().splitlines()]
    assert labels == [
        "total duration",
        "load duration",
        "prompt eval count",
        "prompt eval duration",
        "prompt eval rate",
        "eval count",
        "eval duration",
        "eval rate",
    ]


def test_think_flag_forms():
    assert session_from_args(run_args("m", "--think", "prompt")).think is True
    assert run_args("m", "--think", "prompt").prompt == ["prompt"]
    assert run_args("m", "a", "--verbose", "b", "--think=low", "c").prompt == ["a", "b", "c"]
    with pytest.raises(SystemExit):
        run_args("m", "a", "--bogus")
    assert session_from_args(run_args("m", "--think=false")).think is False
    assert session_from_args(run_args("m", "--think=high")).think == "high"
    assert session_from_args(run_args("m")).think is None
    with pytest.raises(CommandError):
        session_from_args(run_args("m", "--think=loud"))
    with pytest.raises(CommandError):
        session_from_args(run_args("m", "--format", "yaml"))
    with pytest.raises(CommandError):
        session_from_args(run_args("m", "--keepalive", "soon"))


def test_thinking_output_and_hidethinking(api, client):
    api.on("POST", "/api/show", httpx.Response(200, json={}))
    api.on("POST", "/api/generate", generate_answer("42", thinking=["Hmm."]))
    out = Pipe()
    cmd_run(run_args("m", "q", "--think"), client, stdin=Pipe(""), out=out, err=Pipe())
    assert out.getvalue() == "Thinking...\nHmm.\n...done thinking.\n\n42\n"
    assert prompted(api)[0]["think"] is True
    out = Pipe()
    cmd_run(run_args("m", "q", "--hidethinking"), client, stdin=Pipe(""), out=out, err=Pipe())
    assert out.getvalue() == "42\n"


def test_missing_model_is_pulled_first(api, client):
    shows = iter([error(404, "model 'm' not found"), httpx.Response(200, json={})])
    api.on("POST", "/api/show", lambda r: next(shows))
    api.on("POST", "/api/pull", ndjson({"status": "pulling manifest"}, {"status": "success"}))
    api.on("POST", "/api/generate", answering(lambda: generate_answer("ok")))
    assert cmd_run(run_args("m", "hi"), client, stdin=Pipe(""), out=Pipe(), err=Pipe()) == 0
    assert [p for p in api.paths() if p != "HEAD /"] == [
        "POST /api/show",
        "POST /api/pull",
        "POST /api/show",
        "POST /api/generate",
        "POST /api/generate",
    ]


def test_failed_pull_prints_the_servers_error(api, client, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", Pipe(""))
    api.on("POST", "/api/show", error(404, "model 'm' not found"))
    api.on("POST", "/api/pull", error(500, "pull model manifest: file does not exist"))
    assert main(["run", "m", "hi"], client=client) == 1
    assert capsys.readouterr().err.endswith("Error: pull model manifest: file does not exist\n")


def test_error_line_mid_answer(api, client, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", Pipe(""))
    api.on("POST", "/api/show", httpx.Response(200, json={}))
    api.on(
        "POST",
        "/api/generate",
        answering(lambda: ndjson({"response": "par", "done": False}, {"error": "runner crashed"})),
    )
    assert main(["run", "m", "hi"], client=client) == 1
    captured = capsys.readouterr()
    assert captured.out == "par\n"
    assert captured.err == "Error: runner crashed\n"


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_interactive_when_stdin_is_a_terminal(api, client, monkeypatch):
    api.on("POST", "/api/show", httpx.Response(200, json={}))
    api.on("POST", "/api/generate", ndjson({"response": "", "done": True, "done_reason": "load"}))
    api.on(
        "POST",
        "/api/chat",
        ndjson({"message": {"role": "assistant", "content": "yo"}, "done": True}),
    )
    lines = iter(["hello", "/bye"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    monkeypatch.setenv("FREETOKEN_NOHISTORY", "1")
    from freetoken import config

    config.current.cache_clear()
    try:
        assert (
            cmd_run(run_args("m", "--keepalive", "1m"), client, stdin=Tty(), out=Pipe(), err=Pipe())
            == 0
        )
    finally:
        config.current.cache_clear()
    # Preloaded first, then one chat turn.
    assert api.bodies("POST", "/api/generate") == [{"model": "m", "keep_alive": "1m"}]
    assert api.bodies("POST", "/api/chat")[0]["messages"] == [{"role": "user", "content": "hello"}]


def test_the_loading_line_turns_before_bytes_move_and_rates_only_moving_bytes():
    from freetoken.cli.run import loading_line

    first = loading_line("demo", None, 0, 0.4)
    second = loading_line("demo", {"name": "demo:latest", "completed": 0, "total": 9e9}, 1, 3.2)
    assert first.startswith("loading demo ") and first.endswith(" 0s")
    assert second.endswith(" 3s") and "GB/s" not in second and first[13] != second[13]
    moving = {"name": "demo:latest", "completed": 2e9, "total": 8e9, "gbps": 1.5}
    assert loading_line("demo", moving, 2, 4).endswith("2.00/8.00 GB (1.50 GB/s)")
