"""The REPL's `/set` subcommands, which change the Session the next message is sent with."""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from freetoken import options as opts
from freetoken.cli.errors import CommandError
from freetoken.cli.session import parse_think

if TYPE_CHECKING:
    from freetoken.cli.interactive import Repl

__all__ = ["QUOTES", "SetCommands", "unquote"]

HELP = """Set commands:
  /set parameter <name> <value>   a model parameter for this session (temperature, num_ctx, ...)
  /set system <text>              the system message
  /set think [low|medium|high|max]
  /set nothink                    ask the model not to think first
  /set format json                answer in JSON; /set noformat goes back to text
  /set verbose                    print timings after each answer; /set quiet stops them
  /set wordwrap                   wrap answers at the terminal width; /set nowordwrap stops it
  /set history                    keep input history; /set nohistory stops saving it
"""


QUOTES = '"""'


def unquote(text: str) -> str:
    """The text inside `\"\"\"...\"\"\"` or `"..."`, or `text` stripped if it is not quoted."""
    t = text.strip()
    if t.startswith(QUOTES):
        t = t[3:]
        end = t.rfind(QUOTES)
        return t[:end] if end >= 0 else t
    if len(t) >= 2 and t[0] == t[-1] == '"':
        return t[1:-1]
    return t


class SetCommands:
    def __init__(self, repl: Repl) -> None:
        self.repl = repl
        self.handlers: dict[str, Callable[[str], None]] = {
            "parameter": self._parameter,
            "system": self._system,
            "think": self._think,
            "nothink": self._nothink,
            "format": self._format,
            "noformat": self._noformat,
            "verbose": lambda _: self._flag("verbose", True, "Set 'verbose' mode."),
            "quiet": lambda _: self._flag("verbose", False, "Set 'quiet' mode."),
            "wordwrap": lambda _: self._flag("wordwrap", True, "Set 'wordwrap' mode."),
            "nowordwrap": lambda _: self._flag("wordwrap", False, "Set 'nowordwrap' mode."),
            "history": lambda _: self._history(True),
            "nohistory": lambda _: self._history(False),
        }

    def help(self) -> str:
        return HELP

    def run(self, rest: str) -> bool:
        parts = rest.strip().split(None, 1)
        if not parts:
            self.repl.out.write(HELP)
            return True
        handler = self.handlers.get(parts[0].lower())
        if handler is None:
            self.repl.say(f"Unknown command '/set {parts[0]}'. Type /? set for help")
            return True
        handler(parts[1] if len(parts) > 1 else "")
        return True

    def _parameter(self, arg: str) -> None:
        parts = arg.split()
        if len(parts) < 2:
            raise CommandError("usage: /set parameter <name> <value>")
        name, values = parts[0].lower(), [unquote(v) for v in parts[1:]]
        kind = opts.OPTION_TYPES.get(name)
        if kind is None:
            close = difflib.get_close_matches(name, list(opts.OPTION_TYPES), n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            self.repl.say(
                f"Unknown parameter '{name}'.{hint} Known parameters: "
                + ", ".join(sorted(opts.OPTION_TYPES))
            )
            return
        try:
            # Several words set several stop strings, as `PARAMETER stop` lines do.
            if kind == "list[str]":
                value: Any = values
            else:
                value = opts.coerce(name, " ".join(values), from_text=True)
        except opts.OptionError as e:
            self.repl.say(f"Couldn't set parameter: {e}")
            return
        self.repl.session.options[name] = value
        self.repl.say(f"Set parameter '{name}' to '{', '.join(values)}'")

    def _system(self, arg: str) -> None:
        text = unquote(arg)
        self.repl.session.system = text or None
        self.repl.say("Set system message." if text else "Cleared system message.")

    def _think(self, arg: str) -> None:
        self.repl.session.think = parse_think(arg or "true")
        level = self.repl.session.think
        if isinstance(level, str):
            self.repl.say(f"Set 'think' mode to '{level}'.")
        else:
            self.repl.say("Set 'think' mode.")

    def _nothink(self, _: str) -> None:
        self.repl.session.think = False
        self.repl.say("Set 'nothink' mode.")

    def _format(self, arg: str) -> None:
        if arg.strip().lower() != "json":
            self.repl.say("Invalid or missing format. For JSON answers use '/set format json'")
            return
        self.repl.session.format = "json"
        self.repl.say("Set format to 'json' mode.")

    def _noformat(self, _: str) -> None:
        self.repl.session.format = None
        self.repl.say("Disabled format.")

    def _flag(self, attr: str, value: bool, message: str) -> None:
        setattr(self.repl.session, attr, value)
        self.repl.say(message)

    def _history(self, on: bool) -> None:
        if self.repl.history is not None:
            self.repl.history.enabled = on and self.repl.history.path is not None
        self.repl.say("Set 'history' mode." if on else "Set 'nohistory' mode.")
