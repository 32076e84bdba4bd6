"""The contract of a chat format: how one family's model writes its thinking and its tool
calls, and what its template reads.

A format makes the parser that splits a request's output into events (protocol.Event:
`content`, `thinking`, `tool_calls`, and `tool_call_start`/`tool_call_delta` while a call's
arguments stream, `tool_call_truncated` for a call the token limit cut), the grammars its
calls follow (forced, and under `auto` from the call's opening marker on), and the template
variables a think setting becomes. Which format a model has is declared by its architecture
(formats/__init__.py); the template's markers decide only for models no architecture claims.

Every parser keeps to the same rules: markup never reaches content or thinking (text that
may be the start of a marker is held back until it is decided), content before a call
streams, and a call that does not parse is shown as its text with the markers removed,
so nothing is silently lost (Qwen's keeps its markers, as it always has). Without tools,
call markup is text.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from freetoken.chat.template import think_variables

if TYPE_CHECKING:
    from freetoken.chat.grammar import Grammar

__all__ = ["CallSection", "ChatFormat", "Event", "ParseOptions", "Parser"]

Event = dict[str, Any]


@dataclass(frozen=True)
class ParseOptions:
    """What a request's output is parsed with."""

    tools: bool = False  # tools were offered: calls are parsed (else call markup is text)
    schemas: Mapping[str, Any] = field(default_factory=dict)  # tool name -> its parameters
    prompt: str = ""  # the rendered prompt: its end may have opened a section
    show_thinking: bool = True  # think:false: thinking the model does anyway is dropped
    stream_calls: bool = False  # also emit tool_call_start / tool_call_delta


class Parser(Protocol):
    def feed(self, text: str) -> list[Event]:
        """Events for what the new text decides (text that may be a marker waits)."""

    def finish(self, cut: bool = False) -> list[Event]:
        """Events for whatever is left once the output has ended; `cut`: the token limit
        ended it, so a call in progress is a `tool_call_truncated` event, never content."""


class CallSection(ABC):
    """One tool-call section, read from just after its open marker as the output grows.

    `feed` and `finish` get the section's whole text so far (the same string grows between
    calls) and return the events it completes (whole calls, and argument deltas when
    streaming) with the index in that text just past the section's end, or -1 while it
    goes on. Text after the end is the parser's again."""

    @abstractmethod
    def feed(self, body: str) -> tuple[list[Event], int]: ...

    @abstractmethod
    def finish(self, body: str, cut: bool = False) -> tuple[list[Event], int]:
        """The output ended inside the section: what is left, and where the section really
        ended (before the text's end when a marker was hidden by a string never closed).
        `cut`: the token limit ended it; the call in progress is reported truncated."""


class ChatFormat(ABC):
    """One family's conventions. Instances are immutable and shared by requests."""

    name: ClassVar[str]
    # texts of the control tokens the parser reads: they decode as text, though the
    # tokenizer marks them special (tokens of this text are never string content in a grammar)
    markers: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def from_template(cls, template: str | None) -> ChatFormat:
        """The format as a model's template writes it (a variant, or markers it never uses)."""
        return cls()

    @abstractmethod
    def parser(self, opts: ParseOptions) -> Parser: ...

    # the grammars include the thinking (else a grammar applies once the thinking has ended)
    grammar_thinks: ClassVar[bool] = False

    def call_grammar(
        self,
        tools: list[dict[str, Any]],
        *,
        parallel: bool = True,
        lenient: bool = False,
        think: bool = True,
    ) -> Grammar | None:
        """The grammar of an answer that is a call (or several: `parallel`) to `tools`
        (functions: name, parameters), in this format's markup; None where the format has
        no calls. `lenient`: keywords the engine cannot enforce are not checked; `think`
        False: no thinking before the calls, where the grammar writes it (`grammar_thinks`)."""
        return None

    def auto_grammar(
        self, tools: list[dict[str, Any]], *, parallel: bool = True, think: bool = True
    ) -> Grammar | None:
        """Free text in which a call, once its opening marker is written, follows its
        tool's schema to its end (None: nothing marks a call's start)."""
        return None

    def thinking_bounds(self) -> tuple[str, str] | None:
        """The markers around thinking: a grammar waits for its end (unless
        `grammar_thinks`), and a thinking budget is spent between them."""
        return None

    def template_variables(self, think: bool | str | None) -> dict[str, Any]:
        """The Jinja variables a think setting becomes (template.think_variables, and any
        name of the family's own)."""
        return think_variables(think)
