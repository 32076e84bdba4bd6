"""Responses objects and their event stream, from runner events.

A stream is response.created and response.in_progress, then each output item in turn:
output_item.added, its parts and deltas (reasoning_summary_text for thinking, output_text
for content, function_call_arguments in several pieces for a call), their .done events and
output_item.done; then response.completed (its response's status is "incomplete" when the
token limit cut the answer short). An error after the stream began is a response.failed
event. Every event carries its `type` and a `sequence_number`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from freetoken.api.compat import Call, argument_pieces, calls_of, new_id
from freetoken.api.errors import APIError
from freetoken.api.sse import event

__all__ = [
    "Meta",
    "ResponseStream",
    "final_status",
    "function_call_item",
    "message_item",
    "reasoning_item",
    "response_object",
]


@dataclass
class Meta:
    """What a response object echoes from its request."""

    model: str
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[Any] = field(default_factory=list)
    tool_choice: Any = "auto"
    reasoning: dict[str, Any] = field(default_factory=dict)
    text: dict[str, Any] = field(default_factory=lambda: {"format": {"type": "text"}})
    id: str = field(default_factory=lambda: new_id("resp_"))
    created_at: int = field(default_factory=lambda: int(time.time()))


def reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    summary = [{"type": "summary_text", "text": text}] if text else []
    return {"id": item_id, "type": "reasoning", "summary": summary}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [_text_part(text)] if status == "completed" else [],
    }


def function_call_item(item_id: str, call: Call, status: str | None = None) -> dict[str, Any]:
    """A call as an output item: "completed", or "incomplete" where the token limit cut it
    (its arguments as far as they got); "in_progress" while its arguments stream."""
    status = status or ("completed" if call.partial is None else "incomplete")
    return {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "call_id": call.id,
        "name": call.name,
        "arguments": call.wire_arguments if status != "in_progress" else "",
    }


def _usage(done: dict[str, Any]) -> dict[str, Any]:
    cached = int(done.get("prompt_cached_count") or 0)
    inp, out = int(done.get("prompt_eval_count") or 0) + cached, int(done.get("eval_count") or 0)
    return {
        "input_tokens": inp,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": out,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": inp + out,
    }


def response_object(
    meta: Meta,
    output: list[dict[str, Any]],
    status: str,
    done: dict[str, Any] | None = None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A `response` in `status`; its usage once `done` (the runner's done event) is known."""
    return {
        "id": meta.id,
        "object": "response",
        "created_at": meta.created_at,
        "status": status,
        "completed_at": int(time.time()) if status == "completed" else None,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": meta.instructions,
        "max_output_tokens": meta.max_output_tokens,
        "model": meta.model,
        "output": output,
        "parallel_tool_calls": True,
        "previous_response_id": None,
        "reasoning": meta.reasoning,
        "store": False,
        "temperature": meta.temperature,
        "text": meta.text,
        "tool_choice": meta.tool_choice,
        "tools": meta.tools,
        "top_p": meta.top_p,
        "truncation": "disabled",
        "usage": _usage(done) if done is not None else None,
        "user": None,
        "metadata": {},
    }


def final_status(done: dict[str, Any]) -> str:
    return "incomplete" if done.get("done_reason") == "length" else "completed"


class ResponseStream:
    """The events of one streamed response."""

    def __init__(self, meta: Meta):
        self.meta = meta
        self.seq = 0
        self.output: list[dict[str, Any]] = []  # finished items
        self.started = False
        self.calls = 0
        # the reasoning or message item being written: its type, id and text so far
        self.open: str | None = None
        self.open_id = ""
        self.text = ""

    def _emit(self, kind: str, **data: Any) -> bytes:
        frame = event({"type": kind, "sequence_number": self.seq, **data}, kind)
        self.seq += 1
        return frame

    def _start(self) -> list[bytes]:
        self.started = True
        snapshot = response_object(self.meta, [], "in_progress")
        return [
            self._emit("response.created", response=snapshot),
            self._emit("response.in_progress", response=snapshot),
        ]

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.open_id, "output_index": len(self.output)}

    def _open(self, kind: str) -> list[bytes]:
        frames = self._close()
        self.open, self.text = kind, ""
        self.open_id = new_id("rs_" if kind == "reasoning" else "msg_")
        if kind == "reasoning":
            item: dict[str, Any] = {"id": self.open_id, "type": "reasoning", "summary": []}
            name, at = "response.reasoning_summary_part.added", {"summary_index": 0}
            part = {"type": "summary_text", "text": ""}
        else:
            item = message_item(self.open_id, "", "in_progress")
            name, at, part = "response.content_part.added", {"content_index": 0}, _text_part("")
        frames.append(
            self._emit("response.output_item.added", output_index=len(self.output), item=item)
        )
        return frames + [self._emit(name, **self._where(), **at, part=part)]

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        where, text = self._where(), self.text
        if self.open == "reasoning":
            at = {"summary_index": 0}
            names = ("response.reasoning_summary_text.done", "response.reasoning_summary_part.done")
            done, part = {"text": text}, {"type": "summary_text", "text": text}
            item = reasoning_item(self.open_id, text)
        else:
            at = {"content_index": 0}
            names = ("response.output_text.done", "response.content_part.done")
            done, part = {"text": text, "logprobs": []}, _text_part(text)
            item = message_item(self.open_id, text)
        frames = [
            self._emit(names[0], **where, **at, **done),
            self._emit(names[1], **where, **at, part=part),
            self._emit("response.output_item.done", output_index=len(self.output), item=item),
        ]
        self.output.append(item)
        self.open = None
        return frames

    def _delta(self, kind: str, text: str) -> list[bytes]:
        frames = self._open(kind) if self.open != kind else []
        self.text += text
        if kind == "reasoning":
            name, at = "response.reasoning_summary_text.delta", {"summary_index": 0}
        else:
            name, at = "response.output_text.delta", {"content_index": 0, "logprobs": []}
        return frames + [self._emit(name, **self._where(), **at, delta=text)]

    def _call(self, call: Call) -> list[bytes]:
        frames = self._close()
        index, item_id = len(self.output), new_id("fc_")
        where = {"item_id": item_id, "output_index": index}
        added = function_call_item(item_id, call, "in_progress")
        frames.append(self._emit("response.output_item.added", output_index=index, item=added))
        arguments = call.wire_arguments
        for piece in argument_pieces(arguments):
            delta = self._emit("response.function_call_arguments.delta", **where, delta=piece)
            frames.append(delta)
        done = {"name": call.name, "arguments": arguments}
        frames.append(self._emit("response.function_call_arguments.done", **where, **done))
        item = function_call_item(item_id, call)
        frames.append(self._emit("response.output_item.done", output_index=index, item=item))
        self.output.append(item)
        return frames

    def on_event(self, ev: dict[str, Any]) -> list[bytes]:
        frames = [] if self.started else self._start()
        if ev.get("thinking"):
            frames += self._delta("reasoning", ev["thinking"])
        if ev.get("content"):
            frames += self._delta("message", ev["content"])
        for call in calls_of(ev, self.calls):
            self.calls += 1
            frames += self._call(call)
        return frames

    def on_done(self, done: dict[str, Any]) -> list[bytes]:
        frames = ([] if self.started else self._start()) + self._close()
        if not self.output:
            frames += self._open("message") + self._close()  # an empty answer is still a message
        final = response_object(self.meta, self.output, final_status(done), done)
        # response.completed even when the token limit cut the answer short (the response's
        # status says so): SDK helpers and Ollama's clients wait for this event to finish.
        return frames + [self._emit("response.completed", response=final)]

    async def frames(self, events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
        async with aclosing(events) as stream:
            async for ev in stream:
                for frame in self.on_done(ev) if ev.get("done") else self.on_event(ev):
                    yield frame

    def error_frame(self, err: APIError) -> bytes:
        error = {"code": "server_error", "message": err.message}
        failed = response_object(self.meta, self.output, "failed", error=error)
        return self._emit("response.failed", response=failed)
