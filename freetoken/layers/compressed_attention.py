"""DeepSeek-V4's attention over the paged pool: one KV head that is key and value alike,
a sliding window of recent tokens, and — in compressed layers — entries that each sum a
window of `ratio` tokens (layers/compressor.py): all of them (heavily compressed attention)
or those the lightning indexer chooses (compressed sparse attention).

    q   = rope(rms(q_b_proj(q_a_norm(q_a_proj(x)))))     [H, D] per token, rms per head
    kv  = rope(kv_norm(kv_proj(x)))                      [D] per token
    o_h = Σ softmax(q_h · k · D^-1/2 ; sink_h) · k        over window ∪ entries
    out = o_b_proj(o_a_proj per group(rope⁻¹(o)))

Rope rotates the last rope_dim dimensions of each head; keys are values, so the output
carries the keys' rotation and is rotated back at the query's position. The output
projection is grouped: heads in `o_groups` groups, each projected on its own to o_lora_rank,
then mixed by o_b_proj.

The pool (KVLayout "compressed") holds per token its kv and its compressor inputs, and the
entries after the token rows: a token that closes a window forms that window's entry (and
indexer key) from its span's inputs in the pool, so chunked prefill, decode and a reused
prefix all read the same entries. Which rows a query reads is a list per query, attended
by layers/sparse.py (one kernel on a GPU).
"""

from __future__ import annotations

import torch
from torch import nn

from freetoken.layers import context, sparse
from freetoken.layers.compressor import Compressor, EntryIndexer, rope_tail
from freetoken.layers.hyper import unweighted_rms_norm
from freetoken.layers.indexer import prefix_top_k
from freetoken.layers.norm import RMSNorm

__all__ = ["CompressedAttention", "GroupedLinear"]


class GroupedLinear(nn.Module):
    """weight [groups · out, in]: group g of the input [.., groups, in] through rows
    [g·out, (g + 1)·out) (the grouped output projection's first half)."""

    def __init__(self, in_per_group: int, out: int, groups: int):
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.empty(groups * out, in_per_group))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.view(self.groups, -1, self.weight.shape[-1])
        return torch.einsum("tgi,goi->tgo", x, w).flatten(1)


class CompressedAttention(nn.Module):
    def __init__(
        self,
        layer: int,
        hidden: int,
        n_heads: int,
        head_dim: int,
        *,
        q_lora_rank: int,
        o_groups: int,
        o_lora_rank: int,
        window: int,
        eps: float,
        compressor: Compressor | None = None,
    ):
        super().__init__()
        self.layer, self.n_heads, self.head_dim = layer, n_heads, head_dim
        self.window, self.eps = window, eps
        self.q_a_proj = nn.Linear(hidden, q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(q_lora_rank, eps)
        self.q_b_proj = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.kv_proj = nn.Linear(hidden, head_dim, bias=False)
        self.kv_norm = RMSNorm(head_dim, eps)
        self.o_a_proj = GroupedLinear(n_heads * head_dim // o_groups, o_lora_rank, o_groups)
        self.o_b_proj = nn.Linear(o_groups * o_lora_rank, hidden, bias=False)
        self.sinks = nn.Parameter(torch.empty(n_heads))
        self.compressor = compressor

    @property
    def indexer(self) -> EntryIndexer | None:
        return getattr(self.compressor, "indexer", None)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        T = x.shape[0]
        cos, sin = rope
        q_resid = self.q_a_norm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).view(T, self.n_heads, self.head_dim)
        q = rope_tail(unweighted_rms_norm(q, self.eps), cos, sin)
        kv = rope_tail(self.kv_norm(self.kv_proj(x))[:, None], cos, sin)
        ctx = context.current()
        pool = ctx.kv.k[self.layer]  # [token rows + entry rows + 1, 1, D]
        pool[ctx.slots] = kv.to(pool.dtype)
        rows = [self._window_rows(ctx.positions)]
        if self.compressor is not None:
            self._store_inputs(x, ctx)
            self._form_entries(ctx)
            rows.append(self._entry_rows_read(x, q_resid, rope, ctx))
        o = sparse.attend(
            q, pool, torch.cat(rows, dim=1), self.head_dim**-0.5, self.head_dim, self.sinks
        )
        o = rope_tail(o, cos, -sin).reshape(T, self.o_a_proj.groups, -1)
        return self.o_b_proj(self.o_a_proj(o))

    # --- the sliding window ------------------------------------------------------------------
    def _window_rows(self, positions: torch.Tensor) -> torch.Tensor:
        """The rows [T, window] of each token's last `window` positions, itself included."""
        at = positions[:, None] + torch.arange(1 - self.window, 1, device=positions.device)
        return sparse.rows_of(torch.where(at >= 0, at, -1))

    # --- forming entries ---------------------------------------------------------------------
    def _store_inputs(self, x: torch.Tensor, ctx: context.StepContext) -> None:
        parts = [self.compressor.inputs(x)]
        if self.indexer is not None:
            parts.append(self.indexer.inputs(x))
        store = ctx.kv.inputs[self.layer]
        store[ctx.slots] = torch.cat(parts, dim=-1)[:, None].to(store.dtype)

    def _entry_row(self, token_rows: torch.Tensor, ctx: context.StepContext) -> torch.Tensor:
        """The entry row of the window whose last token is at token_rows (-1: none): entries
        follow the token rows, `entries_per_page` a page, in their last token's page."""
        P, m = ctx.kv.page_size, self.compressor.ratio
        tokens = ctx.kv.inputs[self.layer].shape[0]
        row = tokens + token_rows // P * max(P // m, 1) + token_rows % P // m
        return torch.where(token_rows >= 0, row, -1)

    def _form_entries(self, ctx: context.StepContext) -> None:
        """Each token that closes a window forms its entry (and indexer key) from the span's
        inputs. A fixed-shape step forms one for every sequence, the open ones' into the
        pool's spare row, so its shapes never depend on where the windows close."""
        c, t = self.compressor, ctx.positions
        m = c.ratio
        at = ((t // m) * m - (c.span - m))[:, None] + torch.arange(c.span, device=t.device)
        valid = (at >= 0) & (at <= t[:, None])
        rows = sparse.rows_of(torch.where(valid, at, -1))  # [T, span]
        closing, slots = t % m == m - 1, ctx.slots
        if ctx.decode is None:  # a prefill forms only the windows it closes
            picked = closing.nonzero()[:, 0]
            if picked.numel() == 0:
                return
            t, closing, slots, rows, valid = (v[picked] for v in (t, closing, slots, rows, valid))
        windows = t // m
        raw = ctx.kv.inputs[self.layer][rows.clamp(min=0), 0]  # [N, span, inputs]
        spare = ctx.kv.k[self.layer].shape[0] - 1
        target = torch.where(closing, self._entry_row(slots, ctx), spare)
        pool = ctx.kv.k[self.layer]
        pool[target] = c.pool(raw[..., : c.inputs_dim], valid, windows)[:, None].to(pool.dtype)
        if self.indexer is not None:
            keys = self.indexer.pool(raw[..., c.inputs_dim :], valid, windows)
            ctx.kv.index[self.layer][target] = keys[:, None].to(pool.dtype)

    # --- which entries each token reads ------------------------------------------------------
    def _entry_rows_read(
        self,
        x: torch.Tensor,
        q_resid: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        ctx: context.StepContext,
    ) -> torch.Tensor:
        """The entry rows [T, K] each token reads: every closed window's, or those its
        indexer chooses."""
        m, t = self.compressor.ratio, ctx.positions
        seen = (t + 1) // m  # windows closed at or before each token
        q = w = None
        if self.indexer is not None:
            q, w = self.indexer.queries(x, q_resid, *rope)
        d = ctx.decode
        if d is None:
            return self._rows_per_sequence(q, w, seen, ctx)
        windows = torch.arange(d.block_table.shape[1] * d.page_size // m, device=t.device)
        visible = windows[None, :] < seen[:, None]
        ends = torch.where(visible, windows * m + m - 1, -1)
        rows = self._entry_row(sparse.rows_of(ends), ctx)  # [B, windows]
        if self.indexer is None or rows.shape[1] == 0:
            return rows
        chosen = self.indexer.choose(q, w, ctx.kv.index[self.layer], rows, seen)
        return torch.where(chosen >= 0, rows.gather(1, chosen.clamp(min=0)), -1)

    def _rows_per_sequence(
        self,
        q: torch.Tensor | None,
        w: torch.Tensor | None,
        seen: torch.Tensor,
        ctx: context.StepContext,
    ) -> torch.Tensor:
        """A prefill's rows, a sequence at a time: its entries' rows and keys once, and with
        an indexer its queries' choice a block of queries at a time."""
        m = self.compressor.ratio
        most = max(s.ctx_len for s in ctx.seqs) // m
        width = most if self.indexer is None else min(self.indexer.topk, most)
        out = torch.full((seen.shape[0], width), -1, dtype=torch.long, device=seen.device)
        for s in ctx.seqs:
            n = s.ctx_len // m
            if n == 0:
                continue
            span = slice(s.q_start, s.q_start + s.q_len)
            ends = s.ctx_slots[torch.arange(n, device=seen.device) * m + m - 1]
            rows = self._entry_row(ends, ctx)  # [n]: window w's entry row
            if self.indexer is None:
                visible = torch.arange(n, device=seen.device)[None, :] < seen[span, None]
                out[span, :n] = torch.where(visible, rows[None, :], -1)
                continue
            keys = ctx.kv.index[self.layer]
            got = prefix_top_k(q[span], w[span], keys, rows, self.indexer.topk, seen[span])
            out[span, : got.shape[1]] = torch.where(got >= 0, rows[got.clamp(min=0)], -1)
        return out
