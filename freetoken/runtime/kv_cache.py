"""The paged KV pool: fixed-size pages, a page list per sequence, reference counts.

Even with one sequence the cache is paged, so prefix sharing (several sequences holding
the same pages), continuous batching and resizing all stand on the same structure.
"""

from __future__ import annotations

import torch

from freetoken.layers.context import KVStore
from freetoken.models.base import KVLayout


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
    """The per-token cache of every layer, as the model's `kv_layout()` describes it:
    k[layer] [num_pages * page_size, heads, k_dim] and v[layer] [..., heads, v_dim] for
    attention layers, k[layer] alone for a latent (MLA) layer, None for layers that keep
    no per-token entry (recurrent state is not paged)."""

    def __init__(
        self,
        layout: list[KVLayout],
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.layout, self.page_size = layout, page_size
        self.pool = PagePool(num_pages)
        slots = num_pages * page_size

        def entry(heads: int, dim: int, paged: bool) -> torch.Tensor | None:
            if not paged or not dim:
                return None
            return torch.zeros(slots, heads, dim, dtype=dtype, device=device)

        self.k = [entry(lay.heads, lay.k_dim, lay.paged) for lay in layout]
        self.v = [entry(lay.heads, lay.v_dim, lay.paged) for lay in layout]

    @classmethod
    def uniform(
        cls,
        num_layers: int,
        num_pages: int,
        page_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> KVCache:
        """Every layer the same GQA attention (benchmarks' and tests' shapes)."""
        layout = [KVLayout.attention(kv_heads, head_dim)] * num_layers
        return cls(layout, num_pages, page_size, dtype, device)

    @staticmethod
    def token_bytes(layout: list[KVLayout], dtype: torch.dtype) -> int:
        """Bytes one cached token takes over every layer (what a page budget is sized by)."""
        size = torch.tensor([], dtype=dtype).element_size()
        return size * sum(lay.heads * (lay.k_dim + lay.v_dim) for lay in layout if lay.paged)

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v if t is not None)

    def copy_page(self, src: int, dst: int, tokens: int) -> None:
        """Copies the first `tokens` entries of page src into page dst, in every layer (a
        prefix cache's private copy of a page it shares only in part)."""
        a, b = src * self.page_size, dst * self.page_size
        for t in self.k + self.v:
            if t is not None:
                t[b : b + tokens].copy_(t[a : a + tokens])

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def slots_of(
        self, pages: list[int], start: int, end: int, device: torch.device
    ) -> torch.Tensor:
        """Slot index of token positions [start, end) of a sequence holding `pages`."""
        pos = torch.arange(start, end)
        page_idx = torch.tensor(pages, dtype=torch.long)[pos // self.page_size]
        return (page_idx * self.page_size + pos % self.page_size).to(device)
