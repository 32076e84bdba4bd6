"""From a typed completion request (protocol.py) to what the engine runs: the prompt's token
ids, a sequence with its sampling parameters, stop tokens and grammar, and the parser that
splits its output into content, thinking and tool calls.

The model's chat format (chat/formats) decides the parser, the grammar of a forced call,
the template variables a think setting becomes and which control tokens decode as text;
it is the format its architecture declares, or for an architecture that declares none,
the one the request's template shows.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from freetoken.chat import formats, structured
from freetoken.chat import template as chat_template
from freetoken.chat.formats import ChatFormat, ParseOptions, Parser
from freetoken.chat.grammar import Grammar, json_format
from freetoken.protocol import CompletionRequest
from freetoken.runtime.constrain import Constraint, Grammars, Thinking
from freetoken.runtime.prompt import Prompt, PromptBuilder, PromptError
from freetoken.runtime.sampling import SamplingParams
from freetoken.runtime.sequence import Sequence
from freetoken.runtime.tokenizer import Tokenizer

__all__ = ["Prepared", "RequestBuilder", "RequestError"]

log = logging.getLogger("freetoken.runner")


class RequestError(ValueError):
    """A request the runner refuses; `status` is the HTTP status it answers with."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class Prepared:
    seq: Sequence
    prompt_tokens: int
    parser: Parser | None  # None: raw text, passed through as content


class RequestBuilder:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompts: PromptBuilder,
        grammars: Grammars,
        num_ctx: int,
        architecture: str | None = None,
    ):
        self.tokenizer, self.prompts, self.num_ctx = tokenizer, prompts, num_ctx
        self.grammars = grammars
        self.architecture = architecture  # the model's model_type: it declares the format

    def capabilities(self, req: CompletionRequest) -> list[str]:
        return chat_template.capabilities(req.template or self.prompts.template)

    def prepare(self, req: CompletionRequest) -> Prepared:
        """The sequence to run and the parser of its output; RequestError if it cannot run."""
        fmt = self._format(req)
        try:
            req, forced = self._resolve(req)
            num_ctx = min(int(req.options.get("num_ctx") or self.num_ctx), self.num_ctx)
            prompt = self.prompts.build(req, num_ctx, fmt.template_variables(req.think))
            params = SamplingParams.from_options(req.options)
            room = num_ctx - len(prompt.ids)
            max_new = room if params.num_predict < 0 else min(room, params.num_predict)
            tok = self.tokenizer
            # a stop string that is a whole (control) token stops on the token: it decodes to
            # no text
            eos = frozenset() if req.options.get("ignore_eos") else tok.eos_ids
            stops = eos | tok.special_ids(params.stop)
            seq = Sequence(prompt.ids, params, max_new, stops)
            seq.reuse = req.options.get("cache_prompt") is not False
            seq.constraint = self._constraint(req, fmt, forced, prompt, stops)
        except (structured.SchemaError, PromptError, chat_template.TemplateError) as e:
            raise RequestError(str(e)) from None
        seq.top_logprobs = req.wants_logprobs
        seq.shown_ids = self.tokenizer.special_ids(fmt.markers)
        calls = forced is not None or not req.format  # a formatted answer is content
        return Prepared(seq, len(prompt.ids), self._parser(req, fmt, prompt.text, calls))

    def count(self, req: CompletionRequest) -> int:
        """How many tokens `prepare` would start from, before any truncation."""
        try:
            req, _ = self._resolve(req)
            variables = self._format(req).template_variables(req.think)
            # a context too large to ever truncate: the count is of the whole rendered request
            return len(self.prompts.build(req, 1 << 62, variables).ids)
        except (structured.SchemaError, PromptError, chat_template.TemplateError) as e:
            raise RequestError(str(e)) from None

    def _resolve(self, req: CompletionRequest) -> tuple[CompletionRequest, str | None]:
        """The request as the runner serves it, and the forced tool call: None, "" (any offered
        tool) or a tool name. Thinking defaults on where the template supports it (as Ollama
        does); tool_choice "none" keeps the tools out of the prompt."""
        if req.think is None and not req.raw and "thinking" in self.capabilities(req):
            req = req.replace(think=True)
        if req.is_generate and req.images:
            raise RequestError("this model does not support images")
        mode, name = structured.tool_choice(
            req.tool_choice, req.options.get("tool_choice"), req.messages, req.tools
        )
        if mode == "none":
            req = req.replace(tools=None)
        return req, (name or "") if mode == "required" else None

    def _format(self, req: CompletionRequest) -> ChatFormat:
        return formats.format_for(self.architecture, req.template or self.prompts.template)

    def _constraint(
        self,
        req: CompletionRequest,
        fmt: ChatFormat,
        forced: str | None,
        prompt: Prompt,
        end_ids: frozenset[int],
    ) -> Constraint | None:
        """The grammar the answer follows and the bounds of its thinking (None: neither)."""
        grammar = self._grammar(req, fmt, forced)
        think = None if req.raw else self._thinking(req, fmt, prompt)
        if grammar is None and (think is None or think.budget is None):
            return None
        matcher = self.grammars.matcher(grammar) if grammar is not None else None
        vocab, eos = self.grammars.vocab, self.grammars.eos_ids
        return Constraint(matcher, vocab, end_ids, eos, think, fmt.grammar_thinks)

    def _grammar(
        self, req: CompletionRequest, fmt: ChatFormat, forced: str | None
    ) -> Grammar | None:
        """Forced calls, else the `format`, else free text whose calls follow their tools'
        schemas once opened (`auto`), else none."""
        parallel, think = req.parallel_tool_calls is not False, req.think is not False
        if forced is not None:
            tools = structured.forced_tools(req.tools or [], forced or None)
            several = req.parallel_tool_calls is True
            grammar = fmt.call_grammar(tools, parallel=several, think=think)
            if grammar is None:
                log.info("a forced call in the %s format is not constrained", fmt.name)
            return grammar
        if req.format:
            return json_format(req.format)
        if req.tools and not req.raw:
            tools = structured.offered_tools(req.tools)
            return fmt.auto_grammar(tools, parallel=parallel, think=think)
        return None

    def _thinking(self, req: CompletionRequest, fmt: ChatFormat, prompt: Prompt) -> Thinking | None:
        """Where the output thinks, and its budget (the server sets it: Anthropic's
        `budget_tokens`, or the think level's)."""
        bounds = fmt.thinking_bounds()
        if bounds is None:
            return None
        think_open, think_close = bounds
        budget = req.think_budget
        anywhere = fmt.grammar_thinks  # a section may open anywhere (Harmony's messages)
        opened = not anywhere and prompt.text.rstrip().endswith(think_open)
        first = self.tokenizer.special_ids([think_open])
        return Thinking(
            think_open.encode(),
            think_close.encode(),
            self.grammars.vocab.encode(think_close),
            budget=budget,
            inside=opened,
            open_ids=first if req.think is not False and not anywhere else (),
            anywhere=anywhere,
        )

    def _parser(
        self, req: CompletionRequest, fmt: ChatFormat, prompt_text: str, calls: bool
    ) -> Parser | None:
        """How this model's output splits into content, thinking and tool calls (not for raw).
        calls=False: an answer held to a `format` is content, even if it looks like a call."""
        if req.raw:
            return None
        opts = ParseOptions(
            tools=calls and bool(req.tools),
            schemas=_schemas(req.tools),
            prompt=prompt_text,
            show_thinking=req.think is not False,
            stream_calls=req.stream_tool_calls,
        )
        return fmt.parser(opts)


def _schemas(tools: list | None) -> dict:
    """Each offered tool's parameters schema, by name (formats that write values as text
    read their types from it)."""
    out = {}
    for tool in tools or []:
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            out[fn["name"]] = fn.get("parameters") or {}
    return out
