"""From a completion request to prompt token ids: render the template, tokenize, truncate.

Truncation follows Ollama: a chat that does not fit in num_ctx loses its oldest
non-system messages first (the last message always stays); what still does not fit is cut
at the token level, keeping the first `num_keep` tokens. With `truncate: false` an
over-long input is an error instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from freetoken.chat import template as chat_template
from freetoken.protocol import CompletionRequest
from freetoken.runtime.tokenizer import Tokenizer


class PromptError(ValueError):
    """The request cannot be turned into a prompt (the API answers 400)."""


@dataclass
class Prompt:
    ids: list[int]
    text: str
    truncated: bool = False


def _messages_for_generate(req: CompletionRequest) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = []
    if req.system:
        msgs.append({"role": "system", "content": req.system})
    msgs.append({"role": "user", "content": req.prompt or ""})
    return msgs


def _clean(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise PromptError("each message needs a role")
        content = m.get("content")
        if content is not None and not isinstance(content, str):
            raise PromptError("message content must be a string")
        if m.get("images"):
            raise PromptError("this model does not support images")
        msg = {**m, "role": m["role"].lower(), "content": content or ""}
        # Hugging Face templates read an earlier answer's reasoning as reasoning_content
        if isinstance(m.get("thinking"), str) and "reasoning_content" not in m:
            msg["reasoning_content"] = m["thinking"]
        out.append(msg)
    return out


class PromptBuilder:
    def __init__(self, tokenizer: Tokenizer, template: str | None):
        self.tokenizer = tokenizer
        self.template = template or tokenizer.chat_template

    def render(
        self,
        messages: list[dict[str, Any]],
        req: CompletionRequest,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """`variables`: the Jinja variables the think setting becomes (the model's format's)."""
        source = req.template or self.template
        if not source:
            # No template at all: plain concatenation, so base models still complete text.
            return "".join(m["content"] for m in messages)
        generate = req.is_generate
        return chat_template.render_any(
            source,
            messages,
            tools=req.tools,
            think=req.think,
            bos_token=self.tokenizer.bos_token,
            eos_token=self.tokenizer.eos_token,
            prompt=req.prompt if generate else None,
            suffix=req.suffix if generate else None,
            variables=variables,
        )

    def build(
        self, req: CompletionRequest, num_ctx: int, variables: Mapping[str, Any] | None = None
    ) -> Prompt:
        truncate = req.truncate
        num_keep = int(req.options.get("num_keep", 4))
        if req.is_generate:
            prefix = list(req.context or [])
            if req.raw:
                text = req.prompt or ""
            else:
                text = self.render(_messages_for_generate(req), req, variables)
            ids = prefix + self.tokenizer.encode(text)
            return self._fit_tokens(Prompt(ids, text), num_ctx, num_keep, truncate)
        messages = _clean(req.messages or [])
        text = self.render(messages, req, variables)
        ids = self.tokenizer.encode(text)
        if len(ids) >= num_ctx and truncate:
            text, ids = self._drop_messages(messages, req, num_ctx, variables)
        return self._fit_tokens(Prompt(ids, text), num_ctx, num_keep, truncate)

    def _drop_messages(
        self,
        messages: list[dict[str, Any]],
        req: CompletionRequest,
        num_ctx: int,
        variables: Mapping[str, Any] | None,
    ) -> tuple[str, list[int]]:
        kept = list(messages)
        while True:
            droppable = [i for i, m in enumerate(kept[:-1]) if m["role"] != "system"]
            if not droppable:
                break
            del kept[droppable[0]]
            text = self.render(kept, req, variables)
            ids = self.tokenizer.encode(text)
            if len(ids) < num_ctx:
                return text, ids
        text = self.render(kept, req, variables)
        return text, self.tokenizer.encode(text)

    @staticmethod
    def _fit_tokens(p: Prompt, num_ctx: int, num_keep: int, truncate: bool) -> Prompt:
        # At least one position must stay free for the first generated token.
        limit = num_ctx - 1
        if len(p.ids) <= limit:
            return p
        if not truncate:
            raise PromptError(
                f"the input length ({len(p.ids)} tokens) exceeds the context length "
                f"({num_ctx} tokens)"
            )
        keep = max(0, min(num_keep, limit))
        p.ids = p.ids[:keep] + p.ids[len(p.ids) - (limit - keep) :]
        p.truncated = True
        return p
