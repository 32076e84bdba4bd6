import io
import json

import httpx
import pytest

from freetoken.cli.interactive import History, Repl
from freetoken.cli.session import Session

from .conftest import error, ndjson, scripted_input
from .test_show import RESP

FINAL = {
    "done": True,
    "done_reason": "stop",
    "total_duration": 2_000_000_000,
    "load_duration": 1_000_000,
    "prompt_eval_count": 5,
    "prompt_eval_duration": 50_000_000,
    "eval_count": 4,
    "eval_duration": 100_000_000,
}


def chat_answer(*deltas, thinking=()):
    chunks = [
        {"message": {"role": "assistant", "content": "", "thinking": t}, "done": False}
        for t in thinking
    ]
    chunks += [{"message": {"role": "assistant", "content": d}, "done": False} for d in deltas]
    chunks.append({"message": {"role": "assistant", "content": ""}, **FINAL})
    return ndjson(*chunks)


@pytest.fixture
def repl_factory(api, client):
    api.on("POST", "/api/chat", chat_answer("Hel", "lo"))
    api.on("POST", "/api/show", httpx.Response(200, json=RESP))

    def make(lines, **session):
        read, prompts = scripted_input(lines)
        out, err = io.StringIO(), io.StringIO()
        repl = Repl(client, Session(model="demo", **session), read=read, out=out, err=err)
        return repl, out, err, prompts

    return make


def test_chat_accumulates_history(api, repl_factory):
    repl, out, _, prompts = repl_factory(["hi", "again", "/bye"])
    assert repl.run() == 0
    first, second = api.bodies("POST", "/api/chat")
    assert first == {
        "model": "demo",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
    }
    assert second["messages"] == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "again"},
    ]
    assert out.getvalue() == "Hello\n\nHello\n\n"
    assert prompts == [">>> "] * 3


def test_multiline_input(api, repl_factory):
    repl, _, _, prompts = repl_factory(['"""first line', "second", 'third"""', "/bye"])
    repl.run()
    assert (
        api.bodies("POST", "/api/chat")[0]["messages"][0]["content"] == "first line\nsecond\nthird"
    )
    assert prompts == [">>> ", "... ", "... ", ">>> "]


def test_single_line_triple_quotes(api, repl_factory):
    repl, *_ = repl_factory(['"""just this"""'])
    repl.run()
    assert api.bodies("POST", "/api/chat")[0]["messages"][0]["content"] == "just this"


def test_set_parameter_is_typed(api, repl_factory):
    repl, out, _, _ = repl_factory(
        [
            "/set parameter num_predict 5",
            "/set parameter temperature 0.5",
            "/set parameter stop <end> ###",
            "hi",
        ]
    )
    repl.run()
    body = api.bodies("POST", "/api/chat")[0]
    assert body["options"] == {"num_predict": 5, "temperature": 0.5, "stop": ["<end>", "###"]}
    assert "Set parameter 'num_predict' to '5'" in out.getvalue()


def test_set_parameter_unknown_and_badly_typed(api, repl_factory):
    repl, out, _, _ = repl_factory(
        [
            "/set parameter temprature 1",
            "/set parameter num_ctx lots",
            "/set parameter num_ctx",
            "hi",
        ]
    )
    repl.run()
    text = out.getvalue()
    assert "Unknown parameter 'temprature'. Did you mean 'temperature'?" in text
    assert "Couldn't set parameter" in text and "num_ctx" in text
    assert "options" not in api.bodies("POST", "/api/chat")[0]


def test_set_system_verbose_format_think(api, repl_factory):
    repl, out, err, _ = repl_factory(
        [
            '/set system """Be',
            'brief."""',
            "/set verbose",
            "/set format json",
            "/set nothink",
            "hi",
            "/set quiet",
            "/set think high",
            "/set noformat",
            "again",
        ]
    )
    repl.run()
    first, second = api.bodies("POST", "/api/chat")
    assert first["messages"][0] == {"role": "system", "content": "Be\nbrief."}
    assert first["format"] == "json" and first["think"] is False
    assert second["think"] == "high" and "format" not in second
    assert err.getvalue().count("\neval rate:") == 1
    assert "total duration:       2s" in err.getvalue()
    assert "Set system message." in out.getvalue()


def test_clear_forgets_the_conversation_but_keeps_the_system(api, repl_factory):
    repl, out, _, _ = repl_factory(["/set system terse", "hi", "/clear", "again"])
    repl.run()
    last = api.bodies("POST", "/api/chat")[-1]
    assert last["messages"] == [
        {"role": "system", "content": "terse"},
        {"role": "user", "content": "again"},
    ]
    assert "Cleared session context" in out.getvalue()


def test_show_commands(api, repl_factory):
    repl, out, _, _ = repl_factory(
        [
            "/show info",
            "/show license",
            "/show template",
            "/show modelfile",
            "/set parameter seed 3",
            "/show parameters",
            "/show system",
        ]
    )
    repl.run()
    text = out.getvalue()
    assert "experts used        8" in text and "  Capabilities\n" in text
    assert "Apache License\nVersion 2.0" in text
    assert "No prompt template was specified for this model." in text
    assert "Model defined parameters:" in text and "User defined parameters:" in text
    assert "seed" in text
    assert "You are terse." in text
    assert len(api.bodies("POST", "/api/show")) == 1  # fetched once, then reused


def test_help_unknown_command_and_bye_variants(repl_factory):
    repl, out, _, _ = repl_factory(
        ["/?", "/help set", "/? shortcuts", "/nope", "/set nope", "/exit", "never"]
    )
    assert repl.run() == 0
    text = out.getvalue()
    assert "/set" in text and "/set parameter <name> <value>" in text and "Ctrl-D" in text
    assert "Unknown command '/nope'" in text and "Unknown command '/set nope'" in text


def test_ctrl_d_exits(repl_factory):
    repl, *_ = repl_factory([])
    assert repl.run() == 0


def test_ctrl_c_at_the_prompt_does_not_exit(api, repl_factory):
    repl, out, _, _ = repl_factory([KeyboardInterrupt(), "hi", "/bye"])
    assert repl.run() == 0
    assert "Use Ctrl + d or /bye to exit." in out.getvalue()
    assert len(api.bodies("POST", "/api/chat")) == 1


def test_ctrl_c_during_an_answer_closes_the_stream_and_returns_to_the_prompt(api, repl_factory):
    closed = []

    class Body:
        def __iter__(self):
            yield (
                json.dumps(
                    {"message": {"role": "assistant", "content": "partial"}, "done": False}
                ).encode()
                + b"\n"
            )
            raise KeyboardInterrupt

        def close(self):
            closed.append(True)

    api.on("POST", "/api/chat", lambda r: httpx.Response(200, stream=ClosingStream(Body())))
    repl, out, _, _ = repl_factory(["hi", "/bye"])
    assert repl.run() == 0
    assert out.getvalue().startswith("partial\n")
    assert closed
    assert repl.session.messages == []


class ClosingStream(httpx.SyncByteStream):
    def __init__(self, body):
        self.body = body

    def __iter__(self):
        return iter(self.body)

    def close(self):
        self.body.close()


def test_server_error_keeps_the_session_alive(api, repl_factory):
    api.on("POST", "/api/chat", error(500, "runner died"))
    repl, _, err, _ = repl_factory(["hi", "/bye"])
    assert repl.run() == 0
    assert "Error: runner died" in err.getvalue()
    assert repl.session.messages == []


def test_thinking_is_shown_unless_hidden(api, repl_factory):
    api.on("POST", "/api/chat", chat_answer("Yes.", thinking=["Let me think."]))
    repl, out, _, _ = repl_factory(["q", "/bye"])
    repl.run()
    assert out.getvalue() == "Thinking...\nLet me think.\n...done thinking.\n\nYes.\n\n"
    repl, out, _, _ = repl_factory(["q", "/bye"], hide_thinking=True)
    repl.run()
    assert out.getvalue() == "Yes.\n\n"
    assert repl.session.messages[-1] == {"role": "assistant", "content": "Yes."}


def test_load_and_save(api, repl_factory):
    api.on("POST", "/api/generate", ndjson({"response": "", "done": True, "done_reason": "load"}))
    api.on("POST", "/api/create", ndjson({"status": "success"}))
    repl, out, _, _ = repl_factory(
        ["hi", "/set parameter seed 1", "/save mine", "/load other", "x"]
    )
    repl.run()
    assert api.bodies("POST", "/api/create") == [
        {
            "model": "mine",
            "from": "demo",
            "parameters": {"seed": 1},
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "Hello"},
            ],
        }
    ]
    assert api.bodies("POST", "/api/chat")[-1]["model"] == "other"
    assert api.bodies("POST", "/api/chat")[-1]["messages"] == [{"role": "user", "content": "x"}]
    assert "Created new model 'mine'" in out.getvalue()


def test_history_can_be_turned_off(tmp_path, repl_factory):
    history = History(tmp_path / "h")
    repl, *_ = repl_factory(["/set nohistory"])
    repl.history = history
    repl.run()
    history.save()
    assert not (tmp_path / "h").exists()
