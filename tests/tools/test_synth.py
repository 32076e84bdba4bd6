"""The synthetic checkpoint writer: a sharded checkpoint holds the same tensors as the one-file
checkpoint of the same seed, under an index that names every tensor's shard."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from freetoken.tools import synth
from tests.fixtures import SYNTH_TINY

_SHAPE = dict(SYNTH_TINY, num_hidden_layers=3)


def test_shards_hold_the_one_file_checkpoints_tensors(tmp_path):
    whole = synth.write_qwen3_moe(tmp_path / "whole", dtype="bfloat16", **_SHAPE)
    sharded = synth.write_qwen3_moe(
        tmp_path / "sharded", dtype="bfloat16", shard_bytes=8 << 10, **_SHAPE
    )
    expected = load_file(str(whole / "model.safetensors"))
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 2 and not (sharded / "model.safetensors").exists()
    n = len(shards)
    assert shards[-1].name == f"model-{n:05d}-of-{n:05d}.safetensors"
    assert not list(sharded.glob(".*"))  # no shard left under its temporary name

    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    got: dict[str, torch.Tensor] = {}
    for shard in shards:
        tensors = load_file(str(shard))
        assert all(index["weight_map"][name] == shard.name for name in tensors)
        got.update(tensors)
    assert set(got) == set(expected) == set(index["weight_map"])
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in expected.values())
    assert json.loads((sharded / "config.json").read_text()) == json.loads(
        (whole / "config.json").read_text()
    )


def test_a_shard_past_its_size_holds_one_tensor(tmp_path):
    """A tensor larger than the shard size is a shard of its own, never split or dropped."""
    items = [("a", torch.zeros(100)), ("b", torch.ones(4)), ("c", torch.ones(200))]
    paths = synth.save_sharded(items, tmp_path, shard_bytes=64)
    assert [sorted(load_file(str(p))) for p in paths] == [["a"], ["b"], ["c"]]
