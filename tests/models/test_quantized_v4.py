"""DeepSeek-V4's experts (SwiGLU of clamped inputs, models/base.py's silu_clamped) quantized
by `create --quantize q8_0`: the packed model continues text as transformers does on the
weights its blocks decode to, and gives the resident model's results under every expert
policy. The limit is lowered so that the clamp is reached: a kernel that skipped it would
give other tokens."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from freetoken.ftw import reader
from freetoken.ftw.convert import convert
from freetoken.kernels.reference import dequantize
from tests import fixtures
from tests.models import family, v4
from tests.models.test_deepseek_v4 import MIXED
from tests.runtime.engine_util import files_of, generate, make_engine


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    path = tmp_path_factory.mktemp("ds4")
    hf = v4.build(path, dict(MIXED, swiglu_limit=1.0), seed=31, original_format=False)
    out = convert(path, tmp_path_factory.mktemp("ftw") / "m", quantize="q8_0")
    return out, _decoded(hf, out)


def _decoded(hf, out):
    """The transformers model with each expert bank replaced by what its blocks decode to."""
    ref = copy.deepcopy(hf)
    w = reader.read(files_of(out), pin=False)
    with torch.no_grad():
        for (layer, bank), t in w.banks.items():
            experts = ref.model.layers[layer].mlp.experts
            param = {"gate_up": experts.gate_up_proj, "down": experts.down_proj}[bank]
            param.copy_(dequantize(t, w.formats[(layer, bank)]).float())
    return ref


def test_every_bank_is_packed(quantized):
    out, _ = quantized
    index = json.loads((out / "ftw.json").read_text())
    banks = [t for t in index["tensors"] if t["kind"] == "bank"]
    assert len(banks) == 8 and {t.get("quant") for t in banks} == {"q8_0"}
    assert index["quantize"] == "q8_0"


def test_greedy_tokens_are_transformers_on_the_decoded_weights(quantized):
    out, ref = quantized
    (seq,) = generate(make_engine(out, dtype="float32"), [family.PROMPT], 16)
    assert seq.output_ids == fixtures.hf_greedy(ref, family.PROMPT, 16)


def test_every_policy_matches_resident(quantized):
    out, ref = quantized
    family.policies_match_resident(out, ref.config.n_routed_experts, 4, dtype="float32")
