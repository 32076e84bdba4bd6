"""Recurrent-state checkpoints at anchors: how a hybrid model reuses a cached prefix.

A hybrid model's attention layers keep per-token K/V, which the prefix cache shares by
pages; its recurrent layers (Gated DeltaNet) keep one state per sequence that sums up every
token so far and cannot be cut at an arbitrary position. So the state is saved at chosen
positions — anchors — into host memory, keyed by the tokens before it, and a new request
resumes from the longest anchor that is a prefix of its tokens and that the prefix cache
still holds the pages of: the state from the anchor, the pages from the trie, and only the
suffix computed.

Which positions: where an agent's next request can diverge from this one, at no cost to
the step that computes them.
- the end of the prompt (the state after a prefill's last chunk: free), which the next
  turn's history extends;
- the last message boundary inside the prompt (after its last anchor token, such as a
  message end), which a turn that re-renders the last answer differently (thinking dropped,
  a call re-serialised) still shares; the final prefill chunk is cut there;
- during decode, after a tool-call opener or the end of a thinking block (each decode
  step's state is available), and the end of the sequence when it finishes, which the
  next turn's history repeats when the client sends the answer back as generated.
- message boundaries inside a long stretch the prompt computes, at most one every
  MARK_SPACING tokens: a turn that edits or re-renders history inside what an earlier turn
  prefilled in one piece (a re-rendered history, a pasted file) then resumes near the edit
  rather than at that earlier turn's start. Chunks are not cut there (a chunk streams every
  expert once, so a cut costs prefill time): the recurrent layers run their span in pieces
  and keep a copy of the state at each mark (layers/deltanet.py), at the cost of that copy.

The store is LRU under a byte budget (FREETOKEN_ANCHOR_CACHE_SIZE, by default a tenth of
the memory free at load, at most 16 GiB): one checkpoint of Qwen3-Next-80B is ~75 MB, so a
few gigabytes hold the recent turns of several agents.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from freetoken.runtime.sequence import Sequence
from freetoken.runtime.state_cache import StateCache

__all__ = ["MARK_SPACING", "Anchor", "AnchorStore", "Anchoring", "default_budget"]

# Tokens between anchors kept inside a prefill chunk: a history edited there re-computes at
# most this many tokens more than it changed (5 % of a 10k-token turn), and a long prefill
# keeps one checkpoint (~75 MB for Qwen3-Next-80B) per this many tokens.
MARK_SPACING = 512


@dataclass(eq=False, slots=True)
class Anchor:
    tokens: tuple[int, ...]  # the tokens the state has consumed
    state: list[torch.Tensor]  # every recurrent layer's states, on the host

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state)


class AnchorStore:
    def __init__(self, budget: int):
        self.budget, self.used = budget, 0
        self._lru: OrderedDict[tuple[int, int], Anchor] = OrderedDict()  # (len, hash) -> anchor
        self.saved = self.reused = 0

    def __len__(self) -> int:
        return len(self._lru)

    def has(self, tokens: list[int]) -> bool:
        return (len(tokens), hash(tuple(tokens))) in self._lru

    def save(self, tokens: list[int], state: list[torch.Tensor]) -> None:
        """Keeps `state` (host copies) as the state after `tokens`; evicts the least
        recently used anchors beyond the budget."""
        anchor = Anchor(tuple(tokens), state)
        if anchor.bytes > self.budget:
            return
        key = (len(tokens), hash(anchor.tokens))
        if (old := self._lru.pop(key, None)) is not None:
            self.used -= old.bytes
        self._lru[key] = anchor
        self.used += anchor.bytes
        self.saved += 1
        while self.used > self.budget:
            _, dropped = self._lru.popitem(last=False)
            self.used -= dropped.bytes

    def find(self, tokens: list[int], limit: int) -> Anchor | None:
        """The longest anchor whose tokens start `tokens` and number at most `limit`."""
        lengths = sorted({n for n, _ in self._lru if 0 < n <= limit}, reverse=True)
        for n in lengths:
            key = (n, hash(tuple(tokens[:n])))
            anchor = self._lru.get(key)
            if anchor is not None and list(anchor.tokens) == tokens[:n]:
                self._lru.move_to_end(key)
                self.reused += 1
                return anchor
        return None

    def stats(self) -> dict[str, int]:
        return {
            "anchors": len(self._lru),
            "anchor_bytes": self.used,
            "anchors_saved": self.saved,
            "anchors_reused": self.reused,
        }


class Anchoring:
    """Where a hybrid model's sequences leave anchors, and the saving of them.

    `ids`: the tokens after which a position is a boundary (message ends, a tool-call
    opener, the end of a thinking block); `state`: the recurrent state slots."""

    def __init__(
        self,
        store: AnchorStore,
        state: StateCache,
        ids: frozenset[int],
        spacing: int = MARK_SPACING,
    ):
        self.store, self.state, self.ids, self.spacing = store, state, ids, spacing

    def positions(self, prompt: list[int]) -> frozenset[int]:
        """The prompt positions to keep: its end, and its last boundary before that."""
        last = next((i + 1 for i in range(len(prompt) - 1, -1, -1) if prompt[i] in self.ids), 0)
        return frozenset(p for p in (last, len(prompt)) if p > 0)

    def marks(self, prompt: list[int]) -> tuple[int, ...]:
        """Message boundaries inside the prompt to keep without cutting a chunk there: one
        at least every `spacing` tokens, none of `positions`."""
        cut, kept, last = self.positions(prompt), [], 0
        for i, t in enumerate(prompt):
            p = i + 1
            if t in self.ids and p - last >= self.spacing and p not in cut:
                kept.append(p)
                last = p
        return tuple(kept)

    def span_marks(self, seq: Sequence, start: int, n: int) -> tuple[int, ...]:
        """The marks of tokens [start, start + n) of `seq` whose state is not kept yet, as
        counts of the span's tokens."""
        inside = (p for p in seq.mark_at if start < p < start + n)
        return tuple(p - start for p in inside if not self.store.has(seq.tokens[:p]))

    def keep_marked(self, seqs: list[Sequence], starts: list[int], marked: dict) -> None:
        """Saves the states the recurrent layers kept at marks (StepContext.marked) as
        anchors, in `snapshot`'s order: every layer's conv state, then every recurrent."""
        for (i, m), layers in marked.items():
            order = sorted(layers)
            conv = [layers[layer][0].to("cpu", copy=True) for layer in order]
            rec = [layers[layer][1].to("cpu", copy=True) for layer in order]
            self.store.save(seqs[i].tokens[: starts[i] + m], conv + rec)

    def after_step(self, seq: Sequence, ended: bool = False) -> None:
        """Keeps the sequence's state if where it now stands is an anchor: a planned prompt
        position, a boundary token just fed in decode, or its end (`ended`)."""
        n = seq.num_cached
        if seq.state_slot is None or n == 0:
            return
        decoded = n > len(seq.prompt_ids) and seq.token_at(n - 1) in self.ids
        if not (ended or decoded or n in seq.anchor_at):
            return
        tokens = seq.tokens[:n]
        if not self.store.has(tokens):
            self.store.save(tokens, self.state.snapshot(seq.state_slot))


def default_budget() -> int:
    """A tenth of the memory available now, at most 16 GiB."""
    from freetoken.ftw.reader import mem_available

    return min((mem_available() or 8 << 30) // 10, 16 << 30)
