"""The checks every model family passes against transformers (fp32, tiny random configs):
a family's test module builds its reference model and calls these.

- logits of a prompt equal transformers' (relative error <= 1e-4);
- a cached decode (prefill, then one token at a time through the paged KV) equals the
  uncached forward;
- 32 greedy tokens equal transformers';
- sequences decoded together (continuous batching, prefill chunks beside decode) equal
  the same sequences alone;
- every expert policy, prefill streaming and a resized cache give the resident logits.
"""

from __future__ import annotations

from pathlib import Path

import torch

from freetoken.layers.context import SeqSpan, StepContext, step_context
from freetoken.moe.backend import ExpertsOps
from tests import fixtures
from tests.runtime.engine_util import full_logits, generate, make_engine

PROMPT = [5, 17, 99, 3, 250, 11, 7, 300, 42, 128, 64, 200]
LONG = [(7 * i + 3) % 500 for i in range(48)]  # longer than a decode step: streamed prefill


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def experts_of(engine):
    return ExpertsOps(engine.model).backend


def logits_match(path: Path, hf, prompt=PROMPT, tol: float = 1e-4) -> None:
    ours = full_logits(make_engine(path), prompt)
    ref = fixtures.hf_logits(hf, prompt)
    assert ours.shape == ref.shape
    assert rel(ours, ref) <= tol


def cached_decode_matches(path: Path, prompt=PROMPT) -> None:
    """Prefill 5 tokens, then one token at a time through the paged KV (and, for models
    with recurrent layers, a state slot): the uncached forward's logits."""
    engine = make_engine(path, page_size=4)  # several pages per sequence
    full = full_logits(engine, prompt)
    kv, state = engine.kv, engine.state
    pages = kv.pool.alloc(kv.pages_for(len(prompt)))
    slot = state.alloc() if state is not None else None
    rows = []
    for start, end in [(0, 5)] + [(i, i + 1) for i in range(5, len(prompt))]:
        ctx_slots = kv.slots_of(pages, 0, end, engine.device)
        span = SeqSpan(0, end - start, end, ctx_slots)
        ctx = StepContext(
            torch.arange(start, end), ctx_slots[start:], [span], kv, torch.arange(end - start)
        )
        if state is not None:
            ctx.state, ctx.state_slots = state, torch.tensor([slot])
        with torch.inference_mode(), step_context(ctx):
            h = engine.model(torch.tensor(prompt[start:end]), ctx.positions)
            rows.append(engine.model.logits(h).float())
    kv.pool.release(pages)
    assert rel(torch.cat(rows), full) <= 1e-5


def greedy_matches(path: Path, hf, prompt=PROMPT, n: int = 32) -> None:
    (seq,) = generate(make_engine(path), [prompt], n)
    assert seq.output_ids == fixtures.hf_greedy(hf, prompt, n)


def batched_matches_single(path: Path, hf) -> None:
    prompts = [PROMPT, PROMPT[:7], [9, 8, 7, 6, 5, 4, 3, 2, 1] * 3]
    engine = make_engine(path, chunk=8, page_size=4, pages=128)
    for p, s in zip(prompts, generate(engine, prompts, 16)):
        assert s.output_ids == fixtures.hf_greedy(hf, p, 16)


def policies_match_resident(
    path: Path, num_experts: int, moe_layers: int, dtype: str = "auto"
) -> None:
    """Every policy at a cache too small for every expert, prefill streaming, and decode
    after shrinking and growing the cache: the resident model's logits and tokens."""
    every = num_experts * moe_layers
    resident = make_engine(path, policy="resident", slots=every, dtype=dtype)
    ref, ref_long = full_logits(resident, PROMPT), full_logits(resident, LONG)
    (want,) = generate(resident, [PROMPT], 12)
    small = max(num_experts + 1, every // 2)
    for policy, slots in [
        ("lru-pcie", small),
        ("cpu-misses", small),
        ("adaptive", small),
        ("adaptive", 0),
        ("static-layers", num_experts),
    ]:
        engine = make_engine(path, policy=policy, slots=slots, dtype=dtype)
        err = rel(full_logits(engine, PROMPT), ref)
        assert err <= 1e-5, (policy, err)
        (seq,) = generate(engine, [PROMPT], 12)
        assert seq.output_ids == want.output_ids, policy
    # prefill streams through two layers' slots of a pool short of every expert; a pool that
    # holds them all fixes them instead (two MoE layers: no pool streams)
    streamed = make_engine(path, policy="lru-pcie", slots=max(2 * num_experts, small), dtype=dtype)
    backend = experts_of(streamed)
    if 2 * num_experts < every:
        assert backend.streamer is not None and not backend.placement.fixed_layers
    else:
        assert backend.streamer is None and backend.cache.fixed.all()
    assert rel(full_logits(streamed, LONG), ref_long) <= 1e-5
    for size in (num_experts, every):
        experts_of(streamed).resize(size)
        assert rel(full_logits(streamed, PROMPT), ref) <= 1e-5
        (seq,) = generate(streamed, [PROMPT], 12)
        assert seq.output_ids == want.output_ids


def prefix_reuse_matches(path: Path, hf) -> None:
    """Prompts resumed from the prefix cache — one extending a cached prompt (its pages
    shared), one that differs inside a page (the page copied in part) — continue as
    transformers does: what a layer keeps beside its tokens (indexer keys, compressed
    entries) is reused or formed again with them."""
    engine = make_engine(path, page_size=4, pages=128, prefix_cache=True)
    base = LONG[:30]
    generate(engine, [base], 1)
    for prompt in (base + [9, 8, 7], base[:21] + [5, 6, 7, 8]):
        (seq,) = generate(engine, [prompt], 8)
        assert seq.cached_tokens >= 20
        assert seq.output_ids == fixtures.hf_greedy(hf, prompt, 8)


def bf16_dtypes_match(path: Path, hf_cls) -> None:
    """Loaded in bf16, every parameter has the dtype transformers gives it in bf16: those its
    reference keeps in fp32 (norms, biases, mixing weights) stay fp32; and the model runs."""
    import torch

    ref = hf_cls.from_pretrained(path, dtype=torch.bfloat16)
    engine = make_engine(path, dtype="bfloat16")
    ours = dict(engine.model.named_parameters())
    theirs = {n: p for n, p in ref.state_dict().items() if n in ours}
    assert {n: p.dtype for n, p in theirs.items()} == {n: ours[n].dtype for n in theirs}
    assert any(p.dtype == torch.float32 for p in theirs.values())
    assert torch.isfinite(full_logits(engine, PROMPT)).all()


def fixed_shape_decode_matches(path: Path, hf, prompt=PROMPT, n: int = 16) -> None:
    """Decode through the fixed-shape step (DecodeView: padded contexts masked by length,
    the path CUDA graphs capture), run eagerly: transformers' tokens."""
    (seq,) = generate(make_engine(path, graphs="eager"), [prompt], n)
    assert seq.output_ids == fixtures.hf_greedy(hf, prompt, n)


def gguf_matches(
    path: Path, hf, work: Path, arch: str, prompt=PROMPT, legacy: bool = False
) -> None:
    """The model written as llama.cpp's converter writes `arch` (F32; `legacy`: as its older
    versions did), converted to FTW and loaded bare: transformers' logits and greedy
    tokens."""
    from freetoken.ftw.convert import convert
    from freetoken.runtime import loader
    from tests.fixtures_gguf import write_gguf

    gguf = write_gguf(hf, path, work / "m.gguf", "F32", arch=arch, legacy=legacy)
    engine = make_engine(convert(gguf, work / "ftw"))
    assert rel(full_logits(engine, prompt), fixtures.hf_logits(hf, prompt)) <= 1e-4
    (seq,) = generate(engine, [prompt], 16)
    assert seq.output_ids == fixtures.hf_greedy(hf, prompt, 16)
    files = loader.with_gguf_metadata({"m.gguf": gguf}, work / "meta")
    bare = loader.load(files, "cpu")
    assert type(bare.model).__module__ == type(engine.model).__module__


def rerandomize_with_biases(model: torch.nn.Module, seed: int) -> None:
    """fixtures.rerandomize, then every bias (projection biases, and routers' correction
    biases, which transformers keeps as buffers) ~ 0.1·randn: centred, as trained biases
    are, rather than around 1 as norm weights."""
    fixtures.rerandomize(model, seed)
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("bias"):
                t.copy_(0.1 * torch.randn(t.shape, generator=g))


def hub_spelling(config: dict, **extra) -> dict:
    """A transformers 5 config.json in the spelling Hub checkpoints use: rope_theta (and a
    partial rotary factor) at the top level instead of rope_parameters, plus `extra`."""
    c = {k: v for k, v in config.items() if k != "rope_parameters"}
    params = config.get("rope_parameters") or {}
    c["rope_theta"] = params["rope_theta"]
    if "partial_rotary_factor" in params:
        c["partial_rotary_factor"] = params["partial_rotary_factor"]
    return {**c, **extra}


def gpu_matches(path: Path, hf, prompt=PROMPT, n: int = 16) -> None:
    """On a GPU (fp32) with the fused kernels and captured CUDA graphs: transformers' logits
    and tokens, alone and batched."""
    engine = make_engine(path, device="cuda", graphs="capture")
    assert rel(full_logits(engine, prompt), fixtures.hf_logits(hf, prompt)) <= 1e-4
    (seq,) = generate(engine, [prompt], n)
    assert seq.output_ids == fixtures.hf_greedy(hf, prompt, n)
    prompts = [prompt[:5], LONG]  # batched, and a prefill longer than a decode step
    for p, s in zip(prompts, generate(engine, prompts, n)):
        assert s.output_ids == fixtures.hf_greedy(hf, p, n)
