"""The Gated DeltaNet layer against transformers' (both projection layouts, fp32, random
weights): a whole prompt without state, and the same prompt as prefill chunks then decode
steps through a pool of state slots, the sequence's state carried across steps."""

from __future__ import annotations

import math

import pytest
import torch

from freetoken.layers import fused
from freetoken.layers.context import DecodeView, SeqSpan, StateStore, StepContext, step_context
from freetoken.layers.deltanet import GatedDeltaNet

pytest.importorskip("transformers")

DIMS = dict(
    hidden_size=48,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    rms_norm_eps=1e-6,
    num_hidden_layers=1,
    layer_types=["linear_attention"],
)


def reference(projections: str, seed: int):
    if projections == "grouped":
        from transformers import Qwen3NextConfig
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

        ref = Qwen3NextGatedDeltaNet(Qwen3NextConfig(**DIMS), 0)
    else:
        from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import (
            Qwen3_5MoeTextConfig,
        )
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
            Qwen3_5MoeGatedDeltaNet,
        )

        ref = Qwen3_5MoeGatedDeltaNet(Qwen3_5MoeTextConfig(**DIMS), 0)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ref.parameters():
            fan_in = p.shape[-1] if p.dim() > 1 else 1
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(fan_in))
    return ref.eval()


def ours(ref, projections: str) -> GatedDeltaNet:
    layer = GatedDeltaNet(0, 48, 2, 4, 16, 8, 4, 1e-6, projections=projections)
    layer.load_state_dict(ref.state_dict())
    return layer


class Pool(StateStore):
    def __init__(self, layer: GatedDeltaNet, slots: int):
        conv, rec = layer.state_shapes
        self.conv = [torch.zeros((slots, *conv))]
        self.recurrent = [torch.zeros((slots, *rec))]


def run(layer, x, spans, state=None, slots=None, decode=False):
    view = DecodeView(torch.zeros((x.shape[0], 1), dtype=torch.long), torch.ones(1), 16)
    ctx = StepContext(
        torch.arange(x.shape[0]),
        torch.arange(x.shape[0]),
        spans,
        None,
        torch.arange(x.shape[0]),
        decode=view if decode else None,
        state=state,
        state_slots=slots,
    )
    with torch.no_grad(), fused.disabled(), step_context(ctx):
        return layer(x)


@pytest.mark.parametrize("projections", ["grouped", "split"])
def test_layer_matches_transformers(projections):
    ref = reference(projections, seed=3)
    layer = ours(ref, projections)
    x = torch.randn((1, 70, 48), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = ref(x)[0]
    got = run(layer, x[0], [SeqSpan(0, 70, 70, torch.arange(70))])
    assert float((got - want).norm() / want.norm()) < 1e-5
    assert layer.state_shapes == ((2 * 32 + 32, 3), (4, 16, 8))


@pytest.mark.parametrize("projections", ["grouped", "split"])
def test_state_carries_across_chunks_and_decode_steps(projections):
    """Two sequences in slots 2 and 0 of a pool of three: prefill chunks of both in one
    step, a second chunk of each, a decode token beside a chunk, then batched decode steps;
    each equals its whole-prompt output."""
    ref = reference(projections, seed=5)
    layer = ours(ref, projections)
    g = torch.Generator().manual_seed(6)
    xa, xb = torch.randn((20, 48), generator=g), torch.randn((17, 48), generator=g)
    want_a = run(layer, xa, [SeqSpan(0, 20, 20, torch.arange(20))])
    want_b = run(layer, xb, [SeqSpan(0, 17, 17, torch.arange(17))])
    pool, slots = Pool(layer, 3), torch.tensor([2, 0])
    pool.recurrent[0][2] = 7.0  # a slot's old contents never leak into a sequence's start
    out = run(
        layer,
        torch.cat((xa[:9], xb[:4])),
        [SeqSpan(0, 9, 9, torch.arange(9)), SeqSpan(9, 4, 4, torch.arange(4))],
        pool,
        slots,
    )
    rows_a, rows_b = [out[:9]], [out[9:]]
    out = run(layer, xa[9:14], [SeqSpan(0, 5, 14, torch.arange(14))], pool, slots[:1])
    rows_a.append(out)
    out = run(layer, xb[4:9], [SeqSpan(0, 5, 9, torch.arange(9))], pool, slots[1:])
    rows_b.append(out)
    # a decode token beside a prefill chunk, in one step
    spans = [SeqSpan(0, 1, 15, torch.arange(15)), SeqSpan(1, 3, 12, torch.arange(12))]
    out = run(layer, torch.cat((xa[14:15], xb[9:12])), spans, pool, slots)
    rows_a.append(out[:1])
    rows_b.append(out[1:])
    for t in range(4):  # both decode together, one token each
        out = run(layer, torch.stack((xa[15 + t], xb[12 + t])), [], pool, slots, decode=True)
        rows_a.append(out[:1])
        rows_b.append(out[1:])
    assert torch.allclose(torch.cat(rows_a), want_a[:19], atol=1e-5)
    assert torch.allclose(torch.cat(rows_b), want_b[:16], atol=1e-5)
    assert not pool.conv[0][1].any() and not pool.recurrent[0][1].any()


def test_continuing_without_a_pool_is_refused():
    layer = ours(reference("split", seed=1), "split")
    with pytest.raises(RuntimeError, match="state pool"):
        run(layer, torch.zeros((2, 48)), [SeqSpan(0, 2, 5, torch.arange(5))])
