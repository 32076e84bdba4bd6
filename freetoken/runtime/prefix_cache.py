"""The prefix cache: a trie of KV pages keyed by the token ids they hold.

Agents resend their whole history every turn and change only its end. Every full page a
sequence computes is entered into the trie under its page of token ids, so a later request
whose tokens start the same way takes those pages instead of computing them again: the
longest cached prefix, then — where the next cached page agrees with the request only in
its first r tokens (an edited or re-tokenised history, or the part of a prompt that must
still run to give logits) — a private copy of that page's first r entries.

Ownership is by reference count in the page pool: the trie holds one reference to every
page in it and each sequence one to every page in its page list, so a page is free only
when neither needs it. Pages only the trie holds are evicted least recently used, leaves
first, when the pool needs room. A page enters the trie once it is full, or — the last,
partly filled page of a sequence that ended — as a leaf keyed by the tokens it holds; a
sequence never writes below its `num_cached`, so shared pages are never written. The end
of one turn is therefore found whole by the next, which differs from it only after it.

The trie is one node per page (children keyed by the page's token tuple): a match is one
dictionary lookup per 16 tokens, and a running sequence adds its pages from the node it
reached last, so decode pays nothing until a page fills.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from freetoken.runtime.kv_cache import PagePool

__all__ = ["Match", "PrefixCache", "divergence"]

log = logging.getLogger("freetoken.runner")

# Eviction frees at least this many pages at once, so a full pool does not walk the trie
# for every page a decode step needs.
EVICT_BATCH = 64


@dataclass(eq=False, slots=True)
class Node:
    key: tuple[int, ...]  # the page's token ids (empty for the root)
    page: int
    parent: Node | None
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)
    used: int = 0  # tick of the last match or insert through this node


@dataclass(slots=True)
class Match:
    """What the trie holds of a token sequence: whole pages, then a partial page to copy."""

    pages: list[int]  # cached pages covering tokens [0, len(pages) * page_size)
    node: Node  # the node of the last whole page (the root when none)
    partial: tuple[int, int] | None = None  # (page, r): its first r tokens also agree
    diverged: tuple[int, ...] = ()  # the cached tokens where the request's first differ

    def tokens(self, page_size: int) -> int:
        return len(self.pages) * page_size + (self.partial[1] if self.partial else 0)


class PrefixCache:
    """`copy(src_page, dst_page, r)` copies the first r token entries of a page in every
    layer (the KV cache's `copy_page`)."""

    def __init__(self, pool: PagePool, page_size: int, copy: Callable[[int, int, int], None]):
        self.pool, self.page_size, self.copy = pool, page_size, copy
        self.root = Node((), -1, None)
        self.nodes: dict[int, Node] = {}  # page -> its node
        self._tick = itertools.count(1)

    @property
    def cached_pages(self) -> int:
        return len(self.nodes)

    # --- lookups ---------------------------------------------------------------------
    def match(self, tokens: list[int], limit: int) -> Match:
        """The cached prefix of tokens[:limit]."""
        P, node, pages, tick = self.page_size, self.root, [], next(self._tick)
        i = 0
        while i + P <= limit:
            child = node.children.get(tuple(tokens[i : i + P]))
            if child is None:
                break
            node, i = child, i + P
            node.used = tick
            pages.append(node.page)
        found = Match(pages, node)
        want = tokens[i : min(i + P, limit)]
        best, best_r = None, 0
        for key, child in node.children.items():
            r = _common(key, want)
            if r > best_r:
                best, best_r = child, r
        if best is not None:
            best.used = tick
            found.partial = (best.page, best_r)
        if best_r < len(want) or i + P <= limit:  # tokens[:limit] was not all found
            if best is not None:
                found.diverged = best.key[best_r:]
            elif node.children:
                found.diverged = next(iter(node.children))
        return found

    # --- sequences -------------------------------------------------------------------
    def acquire(self, tokens: list[int], limit: int) -> tuple[list[int], int, Match]:
        """Pages for a new sequence: the cached prefix of tokens[:limit], shared, plus a
        private copy of a partly matching page. Returns (pages, tokens cached, match)."""
        found = self.match(tokens, limit)
        pages = list(found.pages)
        self.pool.share(pages)
        cached = len(pages) * self.page_size
        if found.partial is not None:
            src, r = found.partial
            if self.pool.num_free == 0:
                self.evict(1, keep=src)
            if self.pool.num_free > 0:
                (dst,) = self.pool.alloc(1)
                self.copy(src, dst, r)
                pages.append(dst)
                cached += r
        return pages, cached, found

    def insert(self, tokens: list[int], pages: list[int], start: Node | None, done: int) -> Node:
        """Enters a sequence's full pages from page `done` on, below `start` (the node its
        page `done - 1` is in; None: the root). Where the trie already holds a page of the
        same tokens, the sequence's page list takes the trie's page instead of its own (the
        two hold the same entries), so concurrent sequences hold a shared prefix once.
        Returns the node of the last page entered."""
        P, node, tick = self.page_size, start or self.root, next(self._tick)
        full = min(len(tokens) // P, len(pages))
        for j in range(done, full):
            key = tuple(tokens[j * P : (j + 1) * P])
            child = node.children.get(key)
            if child is None:
                child = Node(key, pages[j], node)
                node.children[key] = child
                self.nodes[pages[j]] = child
                self.pool.share([pages[j]])
            elif child.page != pages[j]:
                self.pool.share([child.page])
                self.pool.release([pages[j]])
                pages[j] = child.page
            child.used = tick
            node = child
        return node

    def insert_tail(self, tokens: list[int], pages: list[int], start: Node | None) -> None:
        """Enters the last, partly filled page of a sequence that has ended (its full pages
        are in below `start`) as a leaf, unless a leaf of the same tokens is there."""
        P, node = self.page_size, start or self.root
        full = len(tokens) // P
        if len(tokens) == full * P or len(pages) <= full:
            return
        key = tuple(tokens[full * P :])
        if key in node.children:
            return
        leaf = Node(key, pages[full], node, used=next(self._tick))
        node.children[key] = self.nodes[leaf.page] = leaf
        self.pool.share([leaf.page])

    # --- room ----------------------------------------------------------------------------
    def evict(self, n: int, keep: int = -1) -> int:
        """Frees at least n pages (EVICT_BATCH at least, when the trie holds them) that only
        the trie holds, least recently used leaves first. Returns how many were freed."""
        want, freed = max(n, EVICT_BATCH), 0
        heap = [(nd.used, nd.page, nd) for nd in self.nodes.values() if self._evictable(nd, keep)]
        heapq.heapify(heap)
        while heap and freed < want:
            _, _, nd = heapq.heappop(heap)
            parent = nd.parent
            del parent.children[nd.key]
            del self.nodes[nd.page]
            self.pool.release([nd.page])
            freed += 1
            if parent is not self.root and self._evictable(parent, keep):
                heapq.heappush(heap, (parent.used, parent.page, parent))
        return freed

    def _evictable(self, nd: Node, keep: int) -> bool:
        return not nd.children and self.pool.refs[nd.page] == 1 and nd.page != keep

    def clear(self) -> None:
        """Gives every page back (the pool is being replaced or emptied)."""
        self.pool.release(list(self.nodes))
        self.nodes.clear()
        self.root.children.clear()


def _common(a: tuple[int, ...], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def divergence(decode: Callable[[list[int]], str], seq, found: Match) -> str:
    """How much of the sequence's prompt `found` reused, and where and why the rest differs
    from what the cache holds (a history that re-renders to other token ids than were
    generated costs a re-prefill from that point on). `decode`: token ids to text."""
    at = seq.cached_tokens
    ours = seq.tokens[at : at + len(found.diverged)]
    cached_text, our_text = decode(list(found.diverged)), decode(ours)
    same = cached_text.startswith(our_text) or our_text.startswith(cached_text)
    why = "the same text tokenised differently" if same else "the history differs"
    return (
        f"{at} of {len(seq.prompt_ids)} prompt tokens reused; at token {at} {why} "
        f"(cached {cached_text!r}, now {our_text!r})"
    )
