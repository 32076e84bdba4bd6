"""The interactive chat of `freetoken run`: a prompt loop over /api/chat with slash commands.

Input comes from an injected `read(prompt) -> str` (the stdlib `input`, with readline line
editing and history, in real use), so the whole loop can be driven by a list of lines in tests.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from freetoken.cli import show as showmod
from freetoken.cli.client import Client
from freetoken.cli.errors import CommandError, NotRunning, ServerError
from freetoken.cli.session import Session, stream_reply
from freetoken.cli.set_commands import QUOTES, SetCommands, unquote

__all__ = ["History", "Repl"]

PROMPT, CONTINUATION = ">>> ", "... "

HELP = f"""Commands:
  /set            change a session setting (/? set for the list)
  /show           show model information (/? show for the list)
  /load <model>   switch to another model, starting a new conversation
  /save <model>   save the conversation and settings as a new model
  /clear          forget the conversation so far
  /bye            leave (Ctrl-D works too)
  /?, /help       this help; /? shortcuts for line-editing keys

Start a message with {QUOTES} to write several lines; end it with {QUOTES}.
"""

HELP_SHOW = """Show commands:
  /show info         model details
  /show license      the model's license
  /show modelfile    the Modelfile that recreates the model
  /show parameters   the model's and this session's parameters
  /show system       the system message
  /show template     the prompt template
"""

HELP_SHORTCUTS = """Keys:
  Ctrl-A / Ctrl-E    start / end of the line
  Ctrl-B / Ctrl-F    back / forward one character
  Alt-B / Alt-F      back / forward one word
  Ctrl-K / Ctrl-U    delete to the end / start of the line
  Ctrl-W             delete the word before the cursor
  Ctrl-L             clear the screen
  Up / Down          previous / next input
  Ctrl-C             stop the answer being written; at the prompt, drop the line
  Ctrl-D             leave
"""


def _opens_block(line: str) -> bool:
    """A line that starts a multi-line block and does not also close it."""
    stripped = line.lstrip()
    starts = stripped.startswith(QUOTES) or (stripped.startswith("/") and QUOTES in stripped)
    return starts and stripped.count(QUOTES) == 1


class History:
    """readline history in a file, kept unless FREETOKEN_NOHISTORY or `/set nohistory`."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.enabled = path is not None
        try:
            import readline
        except ImportError:
            self.readline = None
            return
        self.readline = readline
        if path is not None:
            try:
                readline.read_history_file(path)
            except OSError:
                pass

    def save(self) -> None:
        if not (self.enabled and self.path and self.readline):
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.readline.set_history_length(1000)
            self.readline.write_history_file(self.path)
        except OSError:
            pass


class Repl:
    def __init__(
        self,
        client: Client,
        session: Session,
        *,
        read: Callable[[str], str] | None = None,
        out: TextIO | None = None,
        err: TextIO | None = None,
        history: History | None = None,
    ) -> None:
        self.client = client
        self.session = session
        self.read = read or input
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.history = history
        self._info: dict[str, Any] | None = None
        self.settings = SetCommands(self)
        self.commands: dict[str, Callable[[str], bool]] = {
            "/bye": lambda _: False,
            "/exit": lambda _: False,
            "/clear": self._clear,
            "/set": self.settings.run,
            "/show": self._show,
            "/load": self._load,
            "/save": self._save,
            "/?": self._help,
            "/help": self._help,
        }

    def say(self, text: str) -> None:
        self.out.write(text if text.endswith("\n") else text + "\n")
        self.out.flush()

    def error(self, e: Exception) -> None:
        self.err.write(f"Error: {e}\n")
        self.err.flush()

    def read_input(self) -> str:
        """One logical input: a line, or a `\"\"\"` block of several lines joined by newlines."""
        line = self.read(PROMPT)
        if not _opens_block(line):
            return line
        lines = [line]
        while True:
            line = self.read(CONTINUATION)
            lines.append(line)
            if QUOTES in line:
                return "\n".join(lines)

    def run(self) -> int:
        while True:
            try:
                if not self.step():
                    return 0
            except KeyboardInterrupt:
                # Ctrl-C at the prompt, or during a command (a slow /show or /load), drops
                # what was in progress; CPython can also deliver a Ctrl-C pressed just as the
                # prompt appeared only once the next key arrives, anywhere in this loop.
                self.say("\nUse Ctrl + d or /bye to exit.")

    def step(self) -> bool:
        """Reads and handles one input; False means leave."""
        try:
            text = self.read_input()
        except EOFError:
            self.say("")
            return False
        if text.lstrip().startswith("/"):
            return self.command(text.strip())
        if text.strip():
            self.chat(unquote(text) if text.lstrip().startswith(QUOTES) else text)
        return True

    def command(self, text: str) -> bool:
        """Runs one slash command; False means leave the loop."""
        parts = text.split(None, 1)
        word, rest = parts[0].lower(), (parts[1] if len(parts) > 1 else "")
        handler = self.commands.get(word)
        if handler is None:
            self.say(f"Unknown command '{parts[0]}'. Type /? for help")
            return True
        try:
            return handler(rest)
        except (CommandError, ServerError, NotRunning) as e:
            self.error(e)
            return True

    def chat(self, text: str) -> None:
        self.session.messages.append({"role": "user", "content": text})
        try:
            reply = stream_reply(
                self.client, "/api/chat", self.session.chat_body(), self.session, self.out, self.err
            )
        except KeyboardInterrupt:
            # The unanswered question is dropped so the history never holds two user turns in a row.
            self.session.messages.pop()
            self.say("")
            return
        except (ServerError, NotRunning) as e:
            self.session.messages.pop()
            self.error(e)
            return
        self.session.messages.append({"role": "assistant", "content": reply.content})
        self.say("")

    def info(self) -> dict[str, Any]:
        if self._info is None:
            self._info = self.client.call("POST", "/api/show", {"model": self.session.model}) or {}
        return self._info

    def _clear(self, _: str) -> bool:
        self.session.messages.clear()
        self.say("Cleared session context")
        return True

    def _show(self, rest: str) -> bool:
        what = rest.strip().lower()
        if what == "info":
            self.out.write(showmod.render(self.info()))
        elif what == "parameters":
            self._show_parameters()
        elif what == "system" and self.session.system:
            self.say(self.session.system)
        elif what in ("license", "modelfile", "system", "template"):
            self.out.write(showmod.field_text(self.info(), what))
        else:
            self.out.write(HELP_SHOW)
        return True

    def _show_parameters(self) -> None:
        model = self.info().get("parameters")
        if model:
            self.say("Model defined parameters:\n" + model.rstrip("\n"))
        elif not self.session.options:
            self.say(showmod.MISSING["parameters"])
        if self.session.options:
            self.say("User defined parameters:")
            for key, value in self.session.options.items():
                self.say(f"{key:<30} {value}")

    def _load(self, rest: str) -> bool:
        name = rest.strip()
        if not name:
            raise CommandError("usage: /load <model>")
        info = self.client.call("POST", "/api/show", {"model": name}) or {}
        self.say(f"Loading model '{name}'")
        self.session.model = name
        self.session.messages.clear()
        self._info = info
        for _ in self.client.stream("/api/generate", {"model": name}):
            pass
        return True

    def _save(self, rest: str) -> bool:
        name = rest.strip()
        if not name:
            raise CommandError("usage: /save <model>")
        body: dict[str, Any] = {
            "model": name,
            "from": self.session.model,
            "messages": list(self.session.messages),
        }
        if self.session.options:
            body["parameters"] = dict(self.session.options)
        if self.session.system:
            body["system"] = self.session.system
        for _ in self.client.stream("/api/create", body):
            pass
        self.say(f"Created new model '{name}'")
        return True

    def _help(self, rest: str) -> bool:
        topic = rest.strip().lower()
        if topic == "set":
            self.out.write(self.settings.help())
        elif topic == "show":
            self.out.write(HELP_SHOW)
        elif topic in ("shortcut", "shortcuts"):
            self.out.write(HELP_SHORTCUTS)
        else:
            self.out.write(HELP)
        return True
