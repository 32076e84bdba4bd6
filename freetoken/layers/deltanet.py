"""The Gated DeltaNet layer (linear attention with a gated delta rule) of hybrid models:
input projections, a short causal convolution over q/k/v, the gated delta rule, a gated
RMSNorm per value head and the output projection. Its math is layers/gated_delta.py.

The layer keeps no per-token cache: each sequence has a conv state (its last K-1 conv
inputs) and a recurrent state per value head, in a slot of the step's state pool
(`StepContext.state`, slots in `state_slots`). A prefill chunk continues from its slot and
leaves its state there, so the chunks of one prompt carry state across steps; a sequence
whose chunk starts at position 0 starts from zero state. A decode step (`DecodeView`)
reads and writes the slots by index on the device, so it can be captured as a graph.

Projection layouts (`projections`):
  grouped  in_proj_qkvz and in_proj_ba, rows grouped by key head: for each key head its q,
           k, then the v and z of the value heads it serves; b and a likewise (Qwen3-Next);
  split    in_proj_qkv (all q, all k, all v), in_proj_z, in_proj_b, in_proj_a (Qwen3.5);
  split_qkvz  in_proj_qkv and in_proj_z as `split` has them, in_proj_ba as `grouped` has
           it (llama.cpp's Qwen3-Next GGUF files: its converter splits the fused q/k/v/z
           projection, not b/a).
"""

from __future__ import annotations

import torch
from torch import nn

from freetoken.layers import context
from freetoken.layers.gated_delta import (
    causal_conv1d,
    chunk_rule,
    conv1d_step,
    decode_rule,
    gated_rms_norm,
    gates,
)

PROJECTIONS = ("grouped", "split", "split_qkvz")


class CausalConv1d(nn.Module):
    """Holds the depthwise kernel as checkpoints store it: weight [C, 1, K]."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(channels, 1, kernel))


class GatedRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps


class GatedDeltaNet(nn.Module):
    def __init__(
        self,
        layer: int,
        hidden: int,
        k_heads: int,
        v_heads: int,
        k_dim: int,
        v_dim: int,
        conv_kernel: int,
        eps: float = 1e-6,
        projections: str = "split",
    ):
        super().__init__()
        if projections not in PROJECTIONS:
            raise ValueError(f"unknown projection layout {projections!r} (one of {PROJECTIONS})")
        if v_heads % k_heads:
            raise ValueError(f"{v_heads} value heads do not share {k_heads} key heads evenly")
        self.layer, self.projections = layer, projections
        self.HK, self.HV, self.Dk, self.Dv = k_heads, v_heads, k_dim, v_dim
        self.key_dim, self.value_dim = k_heads * k_dim, v_heads * v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        if projections == "grouped":
            self.in_proj_qkvz = nn.Linear(hidden, 2 * self.key_dim + 2 * self.value_dim, False)
        else:
            self.in_proj_qkv = nn.Linear(hidden, self.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(hidden, self.value_dim, bias=False)
        if projections == "split":
            self.in_proj_b = nn.Linear(hidden, v_heads, bias=False)
            self.in_proj_a = nn.Linear(hidden, v_heads, bias=False)
        else:
            self.in_proj_ba = nn.Linear(hidden, 2 * v_heads, bias=False)
        self.conv1d = CausalConv1d(self.conv_dim, conv_kernel)
        self.dt_bias = nn.Parameter(torch.ones(v_heads))
        self.A_log = nn.Parameter(torch.zeros(v_heads))
        self.norm = GatedRMSNorm(v_dim, eps)
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False)

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(conv state, recurrent state) of one sequence."""
        return (self.conv_dim, self.conv1d.weight.shape[-1] - 1), (self.HV, self.Dk, self.Dv)

    def project(
        self, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] -> (q|k|v [T, C], z [T, HV, Dv], b [T, HV], a [T, HV])."""
        T = x.shape[0]
        if self.projections == "split":
            z = self.in_proj_z(x).view(T, self.HV, self.Dv)
            return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)
        r = self.HV // self.HK
        b, a = self.in_proj_ba(x).view(T, self.HK, 2 * r).split([r, r], dim=-1)
        if self.projections == "split_qkvz":
            z = self.in_proj_z(x).view(T, self.HV, self.Dv)
            return self.in_proj_qkv(x), z, b.reshape(T, -1), a.reshape(T, -1)
        qkvz = self.in_proj_qkvz(x).view(T, self.HK, -1)
        q, k, v, z = qkvz.split([self.Dk, self.Dk, r * self.Dv, r * self.Dv], dim=-1)
        qkv = torch.cat((q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)), dim=-1)
        return qkv, z.reshape(T, self.HV, self.Dv), b.reshape(T, -1), a.reshape(T, -1)

    def split_heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q|k|v [T, C] -> views q, k [T, HK, Dk] and v [T, HV, Dv]."""
        T = qkv.shape[0]
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (
            q.view(T, self.HK, self.Dk),
            k.view(T, self.HK, self.Dk),
            v.view(T, self.HV, self.Dv),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = context.current()
        qkv, z, b, a = self.project(x)
        if ctx.decode is not None:
            core = self._decode(qkv, a, b, ctx)
        else:
            core = self._prefill(qkv, a, b, ctx)
        out = gated_rms_norm(core, z, self.norm.weight, self.norm.eps)
        return self.out_proj(out.reshape(x.shape[0], -1))

    def _decode(
        self, qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, ctx: context.StepContext
    ) -> torch.Tensor:
        """One token per sequence, each continuing from its slot (state_slots [B])."""
        if ctx.state is None or ctx.state_slots is None:
            raise RuntimeError(f"layer {self.layer} keeps recurrent state: the step has no pool")
        conv, rec = ctx.state.conv[self.layer], ctx.state.recurrent[self.layer]
        slots = ctx.state_slots
        qkv = conv1d_step(qkv, self.conv1d.weight[:, 0], conv, slots)
        return decode_rule(qkv, a, b, self.A_log, self.dt_bias, rec, slots, self.HK)

    def _prefill(
        self, qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, ctx: context.StepContext
    ) -> torch.Tensor:
        """Each sequence's tokens of the step, from its slot's state (or zero state at
        position 0), the state after them written back. Sequences that feed one token after
        others (decode tokens beside prefill chunks) run together as a decode step."""
        out = qkv.new_empty((qkv.shape[0], self.HV, self.Dv))
        steps = []
        if ctx.state is not None:
            steps = [i for i, s in enumerate(ctx.seqs) if s.q_len == 1 and s.ctx_len > 1]
        if steps:
            self._steps(qkv, a, b, ctx, steps, out)
        g, beta = gates(a, b, self.A_log, self.dt_bias)
        weight = self.conv1d.weight[:, 0]
        for i, s in enumerate(ctx.seqs):
            if i in steps:
                continue
            rows = slice(s.q_start, s.q_start + s.q_len)
            conv0, rec0 = self._initial(ctx, i, s)
            y, conv1 = causal_conv1d(qkv[rows], weight, conv0)
            q, k, v = self.split_heads(y)
            if s.marks:
                out[rows], rec1 = self._marked(
                    qkv[rows], conv0, (q, k, v), g[rows], beta[rows], rec0, s.marks, ctx.marked, i
                )
            else:
                out[rows], rec1 = chunk_rule(q, k, v, g[rows], beta[rows], rec0)
            if ctx.state is not None:
                slot = ctx.state_slots[i]
                ctx.state.conv[self.layer][slot] = conv1
                ctx.state.recurrent[self.layer][slot] = rec1
        return out

    def _marked(
        self,
        x: torch.Tensor,
        conv0: torch.Tensor,
        qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        g: torch.Tensor,
        beta: torch.Tensor,
        rec0: torch.Tensor,
        marks: tuple[int, ...],
        marked: dict,
        i: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """chunk_rule over one sequence's span cut at `marks`, each piece continuing from
        the state the last one left; the state after each mark is kept in `marked`. The
        convolution's state after m tokens is its last K-1 inputs: x's rows before m."""
        q, k, v = qkv
        window = torch.cat((conv0.to(x.dtype), x.t()), dim=1)  # [C, K-1+T]
        K1 = conv0.shape[-1]
        out, rec, lo = [], rec0, 0
        for hi in (*marks, x.shape[0]):
            o, rec = chunk_rule(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], rec)
            out.append(o)
            if hi < x.shape[0]:
                conv = window[:, hi : hi + K1].clone()
                marked.setdefault((i, hi), {})[self.layer] = (conv, rec.clone())
            lo = hi
        return torch.cat(out), rec

    def _steps(
        self,
        qkv: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        ctx: context.StepContext,
        steps: list[int],
        out: torch.Tensor,
    ) -> None:
        """The one-token continuations `steps` (indices into ctx.seqs), as one decode step."""
        rows = torch.tensor([ctx.seqs[i].q_start for i in steps], device=qkv.device)
        slots = ctx.state_slots[torch.tensor(steps, device=ctx.state_slots.device)]
        conv, rec = ctx.state.conv[self.layer], ctx.state.recurrent[self.layer]
        y = conv1d_step(qkv[rows], self.conv1d.weight[:, 0], conv, slots)
        out[rows] = decode_rule(y, a[rows], b[rows], self.A_log, self.dt_bias, rec, slots, self.HK)

    def _initial(
        self, ctx: context.StepContext, i: int, s: context.SeqSpan
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if s.ctx_len == s.q_len:  # a sequence's first tokens: zero state, whatever the slot
            device = self.A_log.device
            conv_shape, rec_shape = self.state_shapes
            dtype = self.conv1d.weight.dtype
            return (
                torch.zeros(conv_shape, dtype=dtype, device=device),
                torch.zeros(rec_shape, dtype=torch.float32, device=device),
            )
        if ctx.state is None or ctx.state_slots is None:
            raise RuntimeError(
                f"layer {self.layer} keeps recurrent state: a step that continues a sequence "
                "needs the state pool"
            )
        slot = ctx.state_slots[i]
        return ctx.state.conv[self.layer][slot], ctx.state.recurrent[self.layer][slot]
