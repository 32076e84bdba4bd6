"""From a typed completion request (protocol.py) to what the engine runs: the prompt's token
ids, a sequence with its sampling parameters, stop tokens and grammar, and the parser that
splits its output into content, thinking and tool calls."""

from __future__ import annotations

from dataclasses import dataclass

from freetoken.chat import structured
from freetoken.chat import template as chat_template
from freetoken.chat.output import OutputParser, Style, style_for
from freetoken.protocol import CompletionRequest
from freetoken.runtime.constrain import Constraint, MaskCache
from freetoken.runtime.prompt import Prompt, PromptBuilder, PromptError
from freetoken.runtime.sampling import SamplingParams
from freetoken.runtime.sequence import Sequence
from freetoken.runtime.tokenizer import Tokenizer

__all__ = ["Prepared", "RequestBuilder", "RequestError"]


class RequestError(ValueError):
    """A request the runner refuses; `status` is the HTTP status it answers with."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class Prepared:
    seq: Sequence
    prompt_tokens: int
    parser: OutputParser | None  # None: raw text, passed through as content


class RequestBuilder:
    def __init__(
        self, tokenizer: Tokenizer, prompts: PromptBuilder, masks: MaskCache, num_ctx: int
    ):
        self.tokenizer, self.prompts, self.masks, self.num_ctx = tokenizer, prompts, masks, num_ctx

    def capabilities(self, req: CompletionRequest) -> list[str]:
        return chat_template.capabilities(req.template or self.prompts.template)

    def prepare(self, req: CompletionRequest) -> Prepared:
        """The sequence to run and the parser of its output; RequestError if it cannot run."""
        try:
            req, forced = self._resolve(req)
            num_ctx = min(int(req.options.get("num_ctx") or self.num_ctx), self.num_ctx)
            prompt = self.prompts.build(req, num_ctx)
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
            seq.constraint = self._constraint(req, forced, prompt, stops)
        except (structured.SchemaError, PromptError, chat_template.TemplateError) as e:
            raise RequestError(str(e)) from None
        seq.top_logprobs = req.wants_logprobs
        calls = forced is not None or not req.format  # a formatted answer is content
        return Prepared(seq, len(prompt.ids), self._parser(req, prompt.text, calls))

    def count(self, req: CompletionRequest) -> int:
        """How many tokens `prepare` would start from, before any truncation."""
        try:
            req, _ = self._resolve(req)
            # a context too large to ever truncate: the count is of the whole rendered request
            return len(self.prompts.build(req, 1 << 62).ids)
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

    def _style(self, req: CompletionRequest) -> Style:
        return style_for(req.template or self.prompts.template)

    def _constraint(
        self, req: CompletionRequest, forced: str | None, prompt: Prompt, end_ids: frozenset[int]
    ) -> Constraint | None:
        """The grammar the answer follows: a forced tool call, else the `format`, else none."""
        style = self._style(req)
        if forced is not None:
            tools = req.tools or []
            key = ["call", tools, forced, style.call_open, style.call_close]
            masks = self.masks.get(
                key,
                lambda: structured.tool_call_grammar(
                    tools, forced or None, style.call_open, style.call_close
                ),
            )
        elif req.format:
            masks = self.masks.get(
                ["format", req.format], lambda: structured.format_grammar(req.format)
            )
        else:
            return None
        if req.raw or not style.think_close:
            return Constraint(masks, end_ids)
        # the grammar applies once the thinking section (opened by the prompt, or by the
        # model's first token) has ended
        opened = prompt.text.rstrip().endswith(style.think_open)
        opening = self.tokenizer.special_ids([style.think_open])
        return Constraint(
            masks,
            end_ids,
            thinking=opened,
            think_close=style.think_close.encode(),
            think_open_ids=opening if req.think is not False else frozenset(),
        )

    def _parser(self, req: CompletionRequest, prompt_text: str, calls: bool) -> OutputParser | None:
        """How this model's output splits into content, thinking and tool calls (not for raw).
        calls=False: an answer held to a `format` is content, even if it looks like a call."""
        if req.raw:
            return None
        style = self._style(req)
        # a prompt that ends inside an opened thinking section means the answer starts there
        opened = bool(style.think_open) and prompt_text.rstrip().endswith(style.think_open)
        return OutputParser(
            style,
            tools=calls and bool(req.tools),
            thinking=opened,
            show_thinking=req.think is not False,
            stream_calls=req.stream_tool_calls,
        )
