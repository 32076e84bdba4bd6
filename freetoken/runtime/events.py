"""What a runner streams for one request: its output split by the parser into events, each
carrying the logprobs of the tokens behind it, then the done event (protocol.py)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from freetoken.chat.formats import Parser
from freetoken.protocol import Done, Event, error_event
from freetoken.runtime.sequence import Sequence
from freetoken.runtime.tokenizer import Tokenizer
from freetoken.runtime.vocab import Vocab


@dataclass(eq=False)
class Handle:
    """One request in flight: its sequence, and the queue its events wait in."""

    seq: Sequence
    queue: asyncio.Queue
    prompt_tokens: int
    kind: str
    parser: Parser | None = None  # None: raw text, passed through as content
    logprobs: list[dict[str, Any]] = field(default_factory=list)  # of tokens not yet sent
    t_start: int = field(default_factory=time.perf_counter_ns)

    async def events(self):
        while True:
            event = await self.queue.get()
            yield event
            if event.get("done") or "error" in event:
                return


class EventFormatter:
    """Turns a sequence's new text into events; token bytes for logprobs come from `vocab`."""

    def __init__(self, vocab: Vocab, tokenizer: Tokenizer):
        self.vocab, self.tokenizer = vocab, tokenizer

    def events(self, handle: Handle, text: str, finished: bool) -> list[Event]:
        out: list[Event] = []
        if handle.parser is None:
            out += [{"content": text}] if text else []
        else:
            out += handle.parser.feed(text) if text else []
            # a call the token limit cut is reported as such, never as content
            cut = handle.seq.finish_reason == "length"
            out += handle.parser.finish(cut) if finished else []
        if handle.seq.top_logprobs is not None:
            # each event carries the logprobs of the tokens that led to it; tokens whose
            # text is held back (a marker, a tool call) wait for the next event
            handle.logprobs += self._logprobs(handle.seq)
            if handle.logprobs and (out or finished):
                if not out:
                    out.append({"content": ""})
                out[0]["logprobs"], handle.logprobs = handle.logprobs, []
        if finished:
            if handle.seq.finish_reason == "error":
                out.append(error_event(handle.seq.error or "generation failed"))
            elif handle.seq.finish_reason != "abort":
                out.append(self.done(handle))
        return out

    @staticmethod
    def done(handle: Handle) -> dict[str, Any]:
        seq = handle.seq
        return Done(
            done_reason=seq.finish_reason or "stop",
            prompt_eval_count=handle.prompt_tokens - seq.cached_tokens,
            prompt_eval_duration=seq.prefill_ns,
            eval_count=len(seq.output_ids),
            eval_duration=seq.decode_ns,
            context=seq.prompt_ids + seq.output_ids,
            prompt_cached_count=seq.cached_tokens,
        ).to_json()

    def _logprobs(self, seq: Sequence) -> list[dict[str, Any]]:
        """The logprobs of tokens sampled since the last call, as the events carry them."""
        taken, seq.logprobs = seq.logprobs, []
        return [
            {**self._token(t, lp), "top_logprobs": [self._token(i, v) for i, v in alts]}
            if seq.top_logprobs
            else self._token(t, lp)
            for t, lp, alts in taken
        ]

    def _token(self, token: int, logprob: float) -> dict[str, Any]:
        data = self.vocab.bytes[token] if token < self.vocab.size else b""
        # a control token has no text; its name stands in for it
        text = (
            data.decode("utf-8", "replace")
            if data
            else (self.tokenizer.tok.id_to_token(token) or "")
        )
        return {"token": text, "logprob": logprob, "bytes": list(data or text.encode())}
