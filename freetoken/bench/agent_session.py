"""The agent session `freetoken bench agent` replays, shaped like a coding agent's.

A coding agent (OpenCode, OpenClaw and their kind) sends ~10k tokens of instructions and
tool schemas with every request, then the whole conversation so far: a task, the model's
thinking and tool calls, the tools' results, a final answer, the user's next message. Each
request changes only the end — except where the template re-renders earlier turns (a new
user message makes Qwen3-style templates drop the reasoning of earlier answers) or the
agent edits its history (it elides an old tool result to save context).

The text is generated from a seed, so the session is the same on every machine and version
of the project, and nothing in it is copied from any agent: instructions are composed from
the phrases below, files are generated Python, and tool results are sized like real ones.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Step", "session"]

_WORDS = (
    "module function class method value request response cache page token stream buffer "
    "file path line column test case error message option setting default handler router "
    "server client thread lock queue event state parser schema field record index table "
    "config loader writer reader format layer kernel bank slot policy budget window batch"
).split()
_VERBS = (
    "reads writes checks returns builds parses keeps drops moves splits joins counts sorts "
    "finds opens closes starts stops waits loads saves sends takes gives"
).split()
_RULES = (
    "Prefer the smallest change that solves the task",
    "Read a file before you edit it",
    "Run the tests that cover the code you changed",
    "Never invent a file path: list or search first",
    "Explain what you will do before a change that deletes code",
    "Keep answers short unless the user asks for detail",
    "Quote file paths with the line numbers you mean",
    "Use the todo tool for work of more than three steps",
    "Do not commit unless the user asks you to",
    "Ask before running a command that installs packages",
)
_TOOLS = (
    ("read", "Reads a file of the workspace", ("path", "offset", "limit")),
    ("write", "Writes a whole file", ("path", "content")),
    ("edit", "Replaces one exact string in a file", ("path", "old", "new", "all")),
    ("bash", "Runs a shell command in the workspace", ("command", "timeout", "workdir")),
    ("glob", "Lists files whose path matches a pattern", ("pattern", "path")),
    ("grep", "Searches file contents with a regular expression", ("pattern", "path", "glob")),
    ("list", "Lists a directory", ("path", "ignore")),
    ("todo", "Keeps the list of steps of the current task", ("items", "merge")),
    ("fetch", "Fetches a web page as text", ("url", "format", "timeout")),
    ("task", "Starts a sub-agent on a self-contained task", ("prompt", "description")),
    ("patch", "Applies a unified diff", ("diff", "strip")),
    ("diagnostics", "Reports compiler and linter errors for a file", ("path",)),
    ("test", "Runs the test suite or a selection of it", ("selection", "verbose")),
    ("status", "Shows the version-control status", ("path",)),
    ("diff", "Shows uncommitted changes", ("path", "staged")),
    ("symbols", "Finds definitions and references of a symbol", ("name", "kind", "path")),
)


@dataclass
class Step:
    """One request of the session: messages appended before it, the assistant message the
    session records after it (the agent's history, whatever the model answers), and an
    edit of the history before the request (index, replacement message)."""

    add: list[dict[str, Any]]
    reply: dict[str, Any]
    edit: tuple[int, dict[str, Any]] | None = None
    note: str = ""


@dataclass
class Session:
    system: str
    tools: list[dict[str, Any]]
    steps: list[Step] = field(default_factory=list)


def _sentence(rng: random.Random, n: int = 12) -> str:
    words = [rng.choice(_WORDS) if i % 3 else rng.choice(_VERBS) for i in range(n)]
    return " ".join(words).capitalize() + "."


def _paragraph(rng: random.Random, sentences: int) -> str:
    return " ".join(_sentence(rng, rng.randrange(8, 18)) for _ in range(sentences))


def _tool(rng: random.Random, name: str, summary: str, params: tuple[str, ...]) -> dict:
    props = {
        p: {"type": "string", "description": _paragraph(rng, rng.randrange(1, 3))} for p in params
    }
    description = f"{summary}. " + _paragraph(rng, rng.randrange(3, 7))
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": props, "required": [params[0]]},
        },
    }


def _system(rng: random.Random) -> str:
    parts = ["You are a coding agent working in the user's repository."]
    for i, rule in enumerate(_RULES * 2):
        parts.append(f"{i + 1}. {rule}. " + _paragraph(rng, rng.randrange(2, 5)))
    parts.append("Environment: " + _paragraph(rng, 6))
    return "\n\n".join(parts)


def _code(rng: random.Random, lines: int) -> str:
    out = []
    for i in range(lines):
        a, b = rng.choice(_WORDS), rng.choice(_WORDS)
        out.append(
            rng.choice(
                (
                    f"def {a}_{b}(self, {b}):",
                    f"    {a} = self.{b}.get({i})",
                    f"    return {a}_{b}({a}, {b})",
                    f"class {a.capitalize()}{b.capitalize()}:",
                    f"    # {_sentence(rng, 8)}",
                    f"    if {a} is None:",
                    f"        raise ValueError('{a} {b}')",
                )
            )
        )
    return "\n".join(f"{n + 1:5d}  {line}" for n, line in enumerate(out))


def _call(rng: random.Random, tools: list[dict[str, Any]]) -> dict[str, Any]:
    fn = rng.choice(tools)["function"]
    args = {
        p: f"{rng.choice(_WORDS)}/{rng.choice(_WORDS)}.py" for p in fn["parameters"]["required"]
    }
    return {
        "role": "assistant",
        "content": "",
        "thinking": _paragraph(rng, rng.randrange(2, 5)),
        "tool_calls": [{"function": {"name": fn["name"], "arguments": args}}],
    }


def _result(rng: random.Random, call: dict[str, Any], lines: int) -> dict[str, Any]:
    name = call["tool_calls"][0]["function"]["name"]
    return {"role": "tool", "content": _code(rng, lines), "tool_name": name}


def _answer(rng: random.Random) -> dict[str, Any]:
    return {"role": "assistant", "content": _paragraph(rng, 4), "thinking": _paragraph(rng, 2)}


def session(seed: int = 0) -> Session:
    """24 requests: a task worked through 9 tool calls and answered; a follow-up (the
    template then drops the earlier turn's reasoning) worked through 7 more; the agent
    elides its longest tool result from the history; 6 more tool calls and an answer."""
    rng = random.Random(seed)
    tools = [_tool(rng, *t) for t in _TOOLS]
    s = Session(_system(rng), tools)
    history = [{"role": "system", "content": s.system}]
    reply = _call(rng, tools)
    s.steps.append(Step([{"role": "user", "content": _paragraph(rng, 3)}], reply, note="task"))
    long_at = 0
    for i in range(23):
        history += s.steps[-1].add + [s.steps[-1].reply]
        edit, note = None, ""
        if i == 9:  # the follow-up: earlier reasoning stops being rendered
            add = [{"role": "user", "content": _paragraph(rng, 2)}]
            note = "follow-up (earlier thinking dropped)"
        else:
            size = 100 if i == 1 else rng.randrange(4, 40)
            add = [_result(rng, s.steps[-1].reply, size)]
            long_at = len(history) if i == 1 else long_at
        if i == 16:  # the agent compacts its history
            edit = (long_at, {**history[long_at], "content": "[old tool output elided]"})
            history[long_at] = edit[1]
            note = "history edited"
        reply = _answer(rng) if i in (8, 22) else _call(rng, tools)
        s.steps.append(Step(add, reply, edit, note))
    return s
