"""The paged KV pool: fixed-size pages, a page list per sequence, reference counts.

Even with one sequence the cache is paged, so prefix sharing (several sequences holding
the same pages), continuous batching and resizing all stand on the same structure.
"""

from __future__ import annotations

import torch

from freetoken.layers.context import KVStore


class OutOfPages(RuntimeError):
    """The pool has fewer free pages than a step needs."""


class PagePool:
    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self.refs = [0] * num_pages
        # pop() from the end hands out low page numbers first, which keeps dumps readable
        self.free_list = list(range(num_pages - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self.free_list)

    def alloc(self, n: int) -> list[int]:
        if n > len(self.free_list):
            raise OutOfPages(f"need {n} pages, {len(self.free_list)} free")
        pages = [self.free_list.pop() for _ in range(n)]
        for p in pages:
            self.refs[p] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        for p in pages:
            if self.refs[p] <= 0:
                raise ValueError(f"page {p} is not allocated")
            self.refs[p] += 1

    def release(self, pages: list[int]) -> None:
        for p in pages:
            if self.refs[p] <= 0:
                raise ValueError(f"page {p} released twice")
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self.free_list.append(p)


class KVCache(KVStore):
    """K and V for every layer as [num_pages * page_size, kv_heads, head_dim] slot arrays."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.page_size = page_size
        self.pool = PagePool(num_pages)
        slots = num_pages * page_size
        self.k = [
            torch.zeros(slots, kv_heads, head_dim, dtype=dtype, device=device)
            for _ in range(num_layers)
        ]
        self.v = [
            torch.zeros(slots, kv_heads, head_dim, dtype=dtype, device=device)
            for _ in range(num_layers)
        ]

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def slots_of(
        self, pages: list[int], start: int, end: int, device: torch.device
    ) -> torch.Tensor:
        """Slot index of token positions [start, end) of a sequence holding `pages`."""
        pos = torch.arange(start, end)
        page_idx = torch.tensor(pages, dtype=torch.long)[pos // self.page_size]
        return (page_idx * self.page_size + pos % self.page_size).to(device)
