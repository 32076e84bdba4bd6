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
    no per-token entry (recurrent state is not paged).

    A compressed layer's k holds the token rows, then its entries (`entries_per_page` per
    page, each page's together) and one spare row that writes with nowhere to go land in
    (fixed-shape steps write every sequence's entry, closed or not); inputs[layer] holds
    its tokens' compressor inputs. index[layer] holds an indexer key beside every row of k
    where the layout has one."""

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

        def rows(lay: KVLayout) -> int:
            if lay.kind != "compressed":
                return slots
            return slots + num_pages * lay.entries_per_page(page_size) + 1

        def entry(n: int, heads: int, dim: int, paged: bool) -> torch.Tensor | None:
            if not paged or not dim:
                return None
            return torch.zeros(n, heads, dim, dtype=dtype, device=device)

        self.k = [entry(rows(lay), lay.heads, lay.k_dim, lay.paged) for lay in layout]
        self.v = [entry(slots, lay.heads, lay.v_dim, lay.paged) for lay in layout]
        self.index = [entry(rows(lay), 1, lay.index_dim, lay.paged) for lay in layout]
        self.inputs = [entry(slots, 1, lay.inputs_dim, lay.paged) for lay in layout]

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
    def page_bytes(layout: list[KVLayout], dtype: torch.dtype, page_size: int) -> int:
        """Bytes one page takes over every layer (what a page budget is sized by)."""
        size = torch.tensor([], dtype=dtype).element_size()
        return size * sum(lay.page_values(page_size) for lay in layout)

    def _tensors(self) -> list[torch.Tensor]:
        return [t for t in self.k + self.v + self.index + self.inputs if t is not None]

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def entry_row(self, layer: int, page: int) -> int:
        """The first row of k (and index) holding a compressed layer's entries of `page`."""
        per_page = self.layout[layer].entries_per_page(self.page_size)
        return self.pool.num_pages * self.page_size + page * per_page

    def copy_page(self, src: int, dst: int, tokens: int) -> None:
        """Copies the first `tokens` entries of page src into page dst, in every layer (a
        prefix cache's private copy of a page it shares only in part). A compressed layer's
        entries go whole: those of windows the copy cuts are formed again when their last
        token is computed, before anything reads them."""
        a, b = src * self.page_size, dst * self.page_size
        for t in self._tensors():
            t[b : b + tokens].copy_(t[a : a + tokens])
        for layer, lay in enumerate(self.layout):
            if lay.kind == "compressed":
                n = lay.entries_per_page(self.page_size)
                ea, eb = self.entry_row(layer, src), self.entry_row(layer, dst)
                for t in (self.k[layer], self.index[layer]):
                    if t is not None:
                        t[eb : eb + n].copy_(t[ea : ea + n])

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def slots_of(
        self, pages: list[int], start: int, end: int, device: torch.device
    ) -> torch.Tensor:
        """Slot index of token positions [start, end) of a sequence holding `pages`."""
        pos = torch.arange(start, end)
        page_idx = torch.tensor(pages, dtype=torch.long)[pos // self.page_size]
        return (page_idx * self.page_size + pos % self.page_size).to(device)
