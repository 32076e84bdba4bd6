"""OpenAI answers from runner events: chat.completion(.chunk) and text_completion objects.

A stream sends the assistant role on its first chunk, one chunk per content or reasoning
delta, each tool call as an id/name chunk followed by its arguments in several pieces (the
way hosted APIs stream them, so clients' accumulation is exercised), a separate finish
chunk, an optional usage chunk with no choices, and `data: [DONE]`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from freetoken.api.compat import (
    Call,
    Outcome,
    argument_pieces,
    calls_of,
    new_id,
    openai_error,
)
from freetoken.api.errors import APIError
from freetoken.api.sse import DONE, event

__all__ = ["ChatStream", "CompletionStream", "chat_completion", "text_completion"]

FINGERPRINT = "fp_ollama"


def finish_reason(done_reason: str, calls: bool) -> str:
    # Ollama reports a tool call as an ordinary stop; OpenAI clients look for tool_calls. An
    # answer the limit cut is "length", calls or not (a cut call's arguments are partial).
    if done_reason == "stop" and calls:
        return "tool_calls"
    return done_reason if done_reason in ("stop", "length") else "stop"


def usage(done: dict[str, Any]) -> dict[str, Any]:
    """OpenAI counts every prompt token, and the cached ones among them apart."""
    cached = int(done.get("prompt_cached_count") or 0)
    prompt = int(done.get("prompt_eval_count") or 0) + cached
    completion = int(done.get("eval_count") or 0)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _one_logprob(e: dict[str, Any]) -> dict[str, Any]:
    return {"token": e.get("token", ""), "logprob": e.get("logprob", 0.0), "bytes": e.get("bytes")}


def _logprob(entry: dict[str, Any]) -> dict[str, Any]:
    """A runner logprob entry (Ollama's shape) in OpenAI's."""
    top = [_one_logprob(t) for t in entry.get("top_logprobs") or []]
    return _one_logprob(entry) | {"top_logprobs": top}


def chat_logprobs(entries: list[dict[str, Any]]) -> dict[str, Any] | None:
    return {"content": [_logprob(e) for e in entries]} if entries else None


def text_logprobs(entries: list[dict[str, Any]], offset: int = 0) -> dict[str, Any] | None:
    """Logprobs in the legacy completions shape; `offset`: where the text of the first
    token starts in the whole completion."""
    if not entries:
        return None
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.get("token", ""))
    return {
        "tokens": [e.get("token", "") for e in entries],
        "token_logprobs": [e.get("logprob", 0.0) for e in entries],
        "top_logprobs": [
            {t.get("token", ""): t.get("logprob", 0.0) for t in e.get("top_logprobs") or []}
            for e in entries
        ],
        "text_offset": offsets,
    }


def _tool_call(call: Call) -> dict[str, Any]:
    return {
        "id": call.id,
        "index": call.index,
        "type": "function",
        "function": {"name": call.name, "arguments": call.wire_arguments},
    }


def chat_completion(model: str, out: Outcome) -> dict[str, Any]:
    """The non-streamed `chat.completion` object."""
    message: dict[str, Any] = {"role": "assistant", "content": out.content}
    if out.thinking:
        message["reasoning"] = out.thinking
    if out.calls:
        message["tool_calls"] = [_tool_call(c) for c in out.calls]
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "finish_reason": finish_reason(out.done_reason, bool(out.calls)),
        "logprobs": chat_logprobs(out.logprobs),
    }
    return {
        "id": new_id("chatcmpl-", 12),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": FINGERPRINT,
        "choices": [choice],
        "usage": usage(out.done),
    }


def text_completion(model: str, out: Outcome) -> dict[str, Any]:
    """The non-streamed `text_completion` object."""
    choice = {
        "text": out.content,
        "index": 0,
        "logprobs": text_logprobs(out.logprobs),
        "finish_reason": finish_reason(out.done_reason, False),
    }
    return {
        "id": new_id("cmpl-", 12),
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": FINGERPRINT,
        "choices": [choice],
        "usage": usage(out.done),
    }


def error_frame(err: APIError) -> bytes:
    return event(openai_error(err))


class ChatStream:
    """The `chat.completion.chunk` frames of one streamed answer."""

    def __init__(self, model: str, include_usage: bool = False):
        self.model = model
        self.include_usage = include_usage
        self.id = new_id("chatcmpl-", 12)
        self.created = int(time.time())  # one for the whole stream, as OpenAI sends
        self.role_sent = False
        self.calls = 0

    def _chunk(self, delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
        if not self.role_sent:
            delta = {"role": "assistant", **delta}
            self.role_sent = True
        choice = {"index": 0, "delta": delta, "finish_reason": finish, **extra}
        return event(self._object([choice]))

    def _object(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": FINGERPRINT,
            "choices": choices,
        }

    def _call_frames(self, call: Call) -> list[bytes]:
        head = {"index": call.index, "id": call.id, "type": "function"}
        head["function"] = {"name": call.name, "arguments": ""}
        frames = [self._chunk({"tool_calls": [head]})]
        for piece in argument_pieces(call.wire_arguments):
            delta = {"index": call.index, "function": {"arguments": piece}}
            frames.append(self._chunk({"tool_calls": [delta]}))
        return frames

    def on_event(self, ev: dict[str, Any]) -> list[bytes]:
        deltas = [{"reasoning": ev["thinking"]}] if ev.get("thinking") else []
        deltas += [{"content": ev["content"]}] if ev.get("content") else []
        logprobs = chat_logprobs(ev.get("logprobs") or [])
        if logprobs and not deltas:
            deltas = [{"content": ""}]  # logprobs of tokens whose text was held back
        frames = []
        for i, delta in enumerate(deltas):
            # an event's logprobs go with its first chunk
            extra = {"logprobs": logprobs} if logprobs and i == 0 else {}
            frames.append(self._chunk(delta, **extra))
        if start := ev.get("tool_call_start"):  # a call whose arguments now stream
            head = {
                "index": start["index"],
                "id": new_id("call_", 8),
                "type": "function",
                "function": {"name": start["name"], "arguments": ""},
            }
            frames.append(self._chunk({"tool_calls": [head]}))
        if delta := ev.get("tool_call_delta"):
            piece = {"index": delta["index"], "function": {"arguments": delta["arguments"]}}
            frames.append(self._chunk({"tool_calls": [piece]}))
        if ev.get("streamed"):  # its deltas went out already (a cut call's too)
            self.calls += len(ev.get("tool_calls") or []) + ("tool_call_truncated" in ev)
            return frames
        for call in calls_of(ev, self.calls):
            frames += self._call_frames(call)
            self.calls += 1
        return frames

    def on_done(self, done: dict[str, Any]) -> list[bytes]:
        frames = [] if self.role_sent else [self._chunk({"content": ""})]
        reason = finish_reason(done.get("done_reason") or "stop", self.calls > 0)
        frames.append(self._chunk({}, reason))
        if self.include_usage:
            frames.append(event(self._object([]) | {"usage": usage(done)}))
        return frames + [DONE]

    async def frames(self, events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
        async with aclosing(events) as stream:
            async for ev in stream:
                for frame in self.on_done(ev) if ev.get("done") else self.on_event(ev):
                    yield frame

    error_frame = staticmethod(error_frame)


class CompletionStream:
    """The `text_completion` frames of one streamed /v1/completions answer."""

    def __init__(self, model: str, include_usage: bool = False):
        self.model = model
        self.include_usage = include_usage
        self.id = new_id("cmpl-", 12)
        self.created = int(time.time())
        self.offset = 0  # characters of text sent so far

    def _object(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": FINGERPRINT,
            "choices": choices,
        }

    def _chunk(
        self, text: str, finish: str | None = None, entries: list[dict[str, Any]] | None = None
    ) -> bytes:
        logprobs = text_logprobs(entries or [], self.offset)
        self.offset += len(text)
        choice = {"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish}
        return event(self._object([choice]))

    async def frames(self, events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
        async with aclosing(events) as stream:
            async for ev in stream:
                if not ev.get("done"):
                    # a thinking model's reasoning has no place in a text completion
                    if ev.get("content") or ev.get("logprobs"):
                        yield self._chunk(ev.get("content") or "", entries=ev.get("logprobs"))
                    continue
                yield self._chunk("", finish_reason(ev.get("done_reason") or "stop", False))
                if self.include_usage:
                    yield event(self._object([]) | {"usage": usage(ev)})
                yield DONE

    error_frame = staticmethod(error_frame)
