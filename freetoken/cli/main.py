"""`freetoken`: argument parsing and dispatch to the verbs.

Every verb except `serve` talks to a running server; it first checks that one answers
(`HEAD /`, as Ollama's CLI does) so that "not running" is reported once, clearly.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from freetoken.cli import cache as cache_cli
from freetoken.cli import commands
from freetoken.cli.client import Client
from freetoken.cli.errors import CommandError, NotRunning, ServerError

__all__ = ["build_parser", "main", "parse"]

Handler = Callable[[argparse.Namespace, Client], int]


def _run(args: argparse.Namespace, client: Client) -> int:
    # Imported here: only `run` needs the REPL and readline.
    from freetoken.cli.run import cmd_run

    return cmd_run(args, client)


_HANDLERS: dict[str, Handler] = {
    "create": commands.cmd_create,
    "show": commands.cmd_show,
    "run": _run,
    "stop": commands.cmd_stop,
    "pull": commands.cmd_pull,
    "push": commands.cmd_push,
    "list": commands.cmd_list,
    "ps": commands.cmd_ps,
    "cp": commands.cmd_cp,
    "rm": commands.cmd_rm,
    "version": commands.cmd_version,
    "cache": cache_cli.cmd_cache,
}
_ALIASES = {"ls": "list", "start": "serve"}


def _add_run(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="run a model: one prompt, or an interactive chat")
    p.add_argument("model")
    # default=[]: argparse would otherwise name the optional prompt as required when the
    # model is missing
    p.add_argument("prompt", nargs="*", default=[], help="the prompt; without one, start a chat")
    p.add_argument("--verbose", action="store_true", help="print timings after each answer")
    p.add_argument("--format", help="answer format (json)")
    p.add_argument(
        "--think", metavar="LEVEL", help="--think, --think=false, or --think=low|medium|high|max"
    )
    p.add_argument("--hidethinking", action="store_true", help="do not print the thinking")
    p.add_argument(
        "--keepalive", metavar="DURATION", help="how long the model stays loaded (e.g. 5m)"
    )
    p.add_argument(
        "--nowordwrap", action="store_true", help="do not wrap lines at the terminal width"
    )
    p.add_argument(
        "--insecure", action="store_true", help="allow an insecure registry when pulling"
    )


def _add_show(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("show", help="show information about a model")
    p.add_argument("model")
    for name in commands.SHOW_FIELDS:
        p.add_argument(f"--{name}", action="store_true", help=f"show the model's {name}")
    p.add_argument("-v", "--verbose", action="store_true", help="also show all metadata")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="freetoken", description="Run Mixture-of-Experts models larger than your GPU."
    )
    parser.add_argument("-v", "--version", action="store_true", help="show version information")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser(
        "serve",
        aliases=["start"],
        help="start the server",
        description="Start the server: Ollama's API on FREETOKEN_HOST, models in FREETOKEN_MODELS.",
        epilog=_environment_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p = sub.add_parser("create", help="create a model from a Modelfile")
    p.add_argument("model")
    p.add_argument("-f", "--file", default="Modelfile", help="the Modelfile (default ./Modelfile)")
    p.add_argument("-q", "--quantize", help="quantize the weights while creating (e.g. q8_0)")
    _add_show(sub)
    _add_run(sub)
    sub.add_parser("stop", help="unload a running model").add_argument("model")
    for verb in ("pull", "push"):
        where = "from" if verb == "pull" else "to"
        p = sub.add_parser(verb, help=f"{verb} a model {where} a registry")
        p.add_argument("model")
        p.add_argument("--insecure", action="store_true", help="allow an insecure (http) registry")
    sub.add_parser("list", aliases=["ls"], help="list models")
    sub.add_parser("ps", help="list running models")
    p = sub.add_parser("cp", help="copy a model")
    p.add_argument("source")
    p.add_argument("destination")
    sub.add_parser("rm", help="remove models").add_argument("models", nargs="+", metavar="model")
    cache_cli.add_parser(sub)
    sub.add_parser("help", help="help about a command").add_argument("topic", nargs="?")
    # Local work that needs no server; each module parses its own options.
    for verb, text in _LOCAL.items():
        sub.add_parser(verb, help=text[1], add_help=False).add_argument(
            "rest", nargs=argparse.REMAINDER
        )
    return parser


def _environment_help() -> str:
    """Every setting, as Ollama's `serve --help` lists its variables (with their defaults)."""
    from freetoken import config

    lines = ["environment variables:"]
    for s in config.SETTINGS:
        names = " ".join((s.env, *(f"({a})" for a in s.aliases)))
        default = f" (default {s.default})" if s.default not in (None, "") else ""
        lines.append(f"  {names}\n      {s.description}{default}")
    return "\n".join(lines)


# verb -> (module with main(argv), help)
_LOCAL = {
    "doctor": ("freetoken.doctor.main", "what this machine can serve, and how a model would run"),
    "convert": ("freetoken.ftw.convert", "convert a Hugging Face directory or a GGUF file to FTW"),
    "bench": ("freetoken.bench.main", "measure this machine: bw, load, decode, serve, …"),
}


def _local(command: str, rest: list[str]) -> int:
    import importlib

    try:
        importlib.import_module(_LOCAL[command][0]).main(rest)
    except SystemExit as e:
        if isinstance(e.code, str):  # a message, as the interpreter would print it
            sys.stderr.write(e.code + "\n")
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


def _normalize(argv: list[str]) -> list[str]:
    # A bare `--think` means true; the level must be attached (`--think=high`) so that
    # `run model --think "prompt"` never reads the prompt as a level.
    return ["--think=true" if a == "--think" else a for a in argv]


def _help(parser: argparse.ArgumentParser, topic: str | None) -> int:
    if topic:
        parser.parse_args([topic, "--help"])
    parser.print_help()
    return 0


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    args, extra = parser.parse_known_args(_normalize(argv))
    # argparse stops filling `prompt` at the first option, so `run m hi --verbose there`
    # leaves "there" over; it belongs to the prompt, in order.
    words_only = not any(a.startswith("-") for a in extra)
    if extra and getattr(args, "command", None) == "run" and words_only:
        args.prompt = [*args.prompt, *extra]
    elif extra:
        parser.error("unrecognized arguments: " + " ".join(extra))
    return args


def main(argv: Sequence[str] | None = None, *, client: Client | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _LOCAL:
        return _local(argv[0], argv[1:])
    parser = build_parser()
    args = parse(parser, argv)
    command = "version" if args.version else _ALIASES.get(args.command, args.command)
    if command is None:
        parser.print_help()
        return 0
    if command == "help":
        return _help(parser, args.topic)
    from freetoken.config import ConfigError

    try:
        if command == "serve":
            return commands.cmd_serve(args, None)
        client = client or Client()
        if command != "version":
            client.heartbeat()
        return _HANDLERS[command](args, client)
    except (CommandError, ServerError, NotRunning, ConfigError) as e:
        sys.stderr.write(f"Error: {e}\n")
        return 1
    except KeyboardInterrupt:
        sys.stderr.write("\n")
        return 130
    except BrokenPipeError:
        # The reader went away (`freetoken list | head`); stop quietly, without a traceback.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
