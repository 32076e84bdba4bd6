"""Shared fixtures: tiny reference models written once per test session."""

from __future__ import annotations

import os
import sys
import zlib

import pytest

# The servers the suite starts keep no converter started ahead (each would import torch
# beside the test on a two-core machine); tests/server/test_serve.py turns it on for its own.
os.environ.setdefault("FREETOKEN_WARM_START", "0")

from tests import fixtures


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seeded_torch(request):
    """Each test draws torch's default generator from a seed of its own name: a test's
    unseeded inputs are the same whichever tests ran before it (one that compared them with a
    fixed tolerance failed only in some orders). torch is not imported for tests without it."""
    if "torch" in sys.modules:
        sys.modules["torch"].manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """(directory, HF model): Hub per-expert layout, Hub config spelling."""
    path = tmp_path_factory.mktemp("tiny-qwen3-moe")
    return path, fixtures.hf_qwen3_moe(path, seed=1)


@pytest.fixture(scope="session")
def tiny_model_fused(tmp_path_factory):
    """(directory, HF model): fused gate_up_proj layout, transformers-5 config spelling."""
    path = tmp_path_factory.mktemp("tiny-qwen3-moe-fused")
    return path, fixtures.hf_qwen3_moe(
        path, seed=2, fused=True, hub_config=False, norm_topk_prob=False
    )


@pytest.fixture(scope="session")
def tiny_model_sharded(tmp_path_factory):
    """(directory, HF model): several safetensors shards with an index, and a dense MLP layer."""
    path = tmp_path_factory.mktemp("tiny-qwen3-moe-sharded")
    return path, fixtures.hf_qwen3_moe(
        path, seed=3, shard_size="200KB", num_hidden_layers=3, mlp_only_layers=[1]
    )
