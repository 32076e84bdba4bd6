"""Sparse attention over chosen pool rows: the torch reference against attention written
out with a mask (a row list is a mask over the pool), the Triton kernel against the
reference — by Triton's interpreter on the CPU and on a GPU — in both of its uses (an
absorbed latent with a key part beyond the value; rows that are key and value whole with a
sink per head), with lists short and long (split and merged), repeated and empty rows."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from freetoken.layers import sparse

INTERPRET = (
    os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
)


def _case(T, H, D, dv, K, N, seed, dtype=torch.float32, device="cpu"):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn((T, H, D), generator=g, device=device).to(dtype)
    pool = torch.randn((N, 1, D + 3), generator=g, device=device).to(dtype)  # rows wider
    rows = torch.randint(0, N, (T, K), generator=g, device=device)
    rows[:, K // 3 :: 3] = -1  # holes in every list
    if T > 1:
        rows[1] = -1  # a token with nothing to attend to
    sinks = torch.randn(H, generator=g, device=device)
    return q, pool, rows, sinks


def _masked(q, pool, rows, scale, dv, sinks):
    """Attention over the whole pool with a mask of each token's rows, counted as often as
    they are listed."""
    N = pool.shape[0]
    count = torch.zeros((rows.shape[0], N + 1)).scatter_add_(
        1, torch.where(rows < 0, N, rows), torch.ones(rows.shape)
    )[:, :N]
    s = torch.einsum("thd,nd->thn", q.double(), pool[:, 0, : q.shape[-1]].double()) * scale
    s = s + torch.log(count)[:, None, :]  # a repeated row weighs as often as it is listed
    if sinks is not None:
        s = torch.cat((s, sinks.double()[None, :, None].expand(s.shape[0], -1, 1)), dim=-1)
    p = torch.softmax(s, dim=-1)[..., :N].nan_to_num()
    return torch.einsum("thn,nd->thd", p, pool[:, 0, :dv].double()).float()


@pytest.mark.parametrize("sink", [False, True])
def test_reference_is_masked_attention(sink):
    q, pool, rows, sinks = _case(5, 4, 24, 16, 20, 40, seed=1)
    sinks = sinks if sink else None
    got = sparse.reference(q, pool, rows, 0.3, 16, sinks)
    want = _masked(q, pool, rows, 0.3, 16, sinks)
    if not sink:  # without a sink an empty list has no defined output; the kernel gives 0
        got, want = got[[0, 2, 3, 4]], want[[0, 2, 3, 4]]
    assert torch.allclose(got, want, atol=1e-5)


# (T, H, D, dv, K): an absorbed latent (key part beyond the value), one split; rows whole
# with a sink, several splits; heads not a multiple of the block
CASES = [(3, 4, 48, 32, 20, True), (2, 20, 32, 32, 700, False), (4, 5, 64, 64, 300, True)]


def _check_kernel(T, H, D, dv, K, sink, dtype=torch.float32, device="cpu", tol=1e-5):
    q, pool, rows, sinks = _case(T, H, D, dv, K, 64, seed=T + K, dtype=dtype, device=device)
    sinks = sinks if sink else None
    got = sparse._kernel(q, pool, rows, 0.2, dv, sinks).float()
    want = sparse.reference(q, pool, rows, 0.2, dv, sinks).float()
    if sinks is None:
        want[1] = 0.0  # an empty list: the kernel's zero
    assert float((got - want).norm() / want.norm()) <= tol


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and triton")
@pytest.mark.parametrize("T,H,D,dv,K,sink", CASES)
def test_kernel_in_the_interpreter(T, H, D, dv, K, sink):
    _check_kernel(T, H, D, dv, K, sink)


@pytest.mark.gpu
@pytest.mark.parametrize("T,H,D,dv,K,sink", CASES + [(64, 64, 576, 512, 2048, False)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_kernel_matches_the_reference_on_a_gpu(T, H, D, dv, K, sink, dtype, tol):
    _check_kernel(T, H, D, dv, K, sink, dtype, "cuda", tol)


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and triton")
@pytest.mark.parametrize("family", ["glm_moe_dsa", "deepseek_v4"])
def test_the_sparse_families_through_the_kernel_in_the_interpreter(family, tmp_path, monkeypatch):
    """GLM-5 and DeepSeek-V4 with their attention and indexer scores in the kernels (the
    interpreter standing in for the GPU): transformers' logits, and its tokens through
    fixed-shape decode steps."""
    from freetoken.layers import indexer
    from tests import fixtures
    from tests.models import family as checks
    from tests.models import mla, test_deepseek_v4, test_glm_moe_dsa, v4
    from tests.runtime.engine_util import generate, make_engine

    if family == "glm_moe_dsa":
        from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

        cls = (GlmMoeDsaConfig, GlmMoeDsaForCausalLM)
        hf = mla.build(tmp_path, *cls, test_glm_moe_dsa.SHARED, seed=41, original_format=False)
    else:
        hf = v4.build(tmp_path, test_deepseek_v4.MIXED, seed=42, original_format=False)
    monkeypatch.setattr(sparse, "kernel_usable", lambda q, pool: True)
    monkeypatch.setattr(indexer, "kernel_usable", lambda q, pool: True)
    prompt = checks.LONG[:20]
    checks.logits_match(tmp_path, hf, prompt=prompt)
    (seq,) = generate(make_engine(tmp_path, graphs="eager"), [prompt], 6)
    assert seq.output_ids == fixtures.hf_greedy(hf, prompt, 6)
