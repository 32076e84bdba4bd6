"""A request as the engine sees it: tokens, pages, sampling parameters, status."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

from freetoken.runtime.sampling import SamplingParams

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    max_new_tokens: int  # from num_predict and the room left in num_ctx
    stop_ids: frozenset[int]
    id: int = field(default_factory=lambda: next(_ids))
    output_ids: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose K/V are in the cache
    cached_tokens: int = 0  # of those, taken from the prefix cache when it was admitted
    reuse: bool = True  # may start from the prefix cache (the `cache_prompt` option)
    # where its full pages end in the prefix cache: the node of its last page entered there,
    # and how many of its pages are entered
    trie_node: Any = None
    trie_pages: int = 0
    anchor_at: frozenset[int] = frozenset()  # prompt positions whose state is kept
    mark_at: tuple[int, ...] = ()  # positions kept from inside a prefill chunk
    resume: Any = None  # the anchor's state its slot starts from (hybrid models)
    state_slot: int | None = None  # its recurrent state's slot (models with recurrent layers)
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    prefill_ns: int = 0
    decode_ns: int = 0
    first_token_ns: int = 0
    constraint: Any = None  # a runtime.constrain.Constraint: the grammar the output follows
    shown_ids: frozenset[int] = frozenset()  # control tokens that decode as text (markers)
    top_logprobs: int | None = None  # None: no logprobs; else alternatives per token
    # (token, logprob, alternatives) of sampled tokens not yet sent
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_at(self, i: int) -> int:
        """tokens[i], without building the list (a long context's is a long copy)."""
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_prefilling(self) -> bool:
        return self.num_cached < len(self.prompt_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED
