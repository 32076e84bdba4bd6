"""Every family through the HTTP API: a model created from its Hugging Face directory (so
converted to FTW) continues a raw prompt with transformers' 32 greedy tokens."""

from __future__ import annotations

import json

import httpx
import pytest

from freetoken import models
from freetoken.runtime.tokenizer import Tokenizer
from freetoken.store import CreateSpec, Store
from tests import fixtures
from tests.runtime.engine_util import files_of
from tests.server.harness import LiveServer, make_config

PROMPT = "The quick brown fox jumps over the lazy dog. def parse(text):"


def _families():
    """(name, builder) where builder(tmp_path_factory) -> (directory, transformers model)."""
    from tests.models import (
        test_deepseek_v2,
        test_deepseek_v3,
        test_deepseek_v4,
        test_glm4_moe,
        test_glm4_moe_lite,
        test_glm_moe_dsa,
        test_gpt_oss,
        test_minimax_m2,
        test_mixtral,
        test_olmoe,
        test_qwen2_moe,
        test_qwen3_5_moe,
        test_qwen3_next,
    )

    return {
        "qwen2-moe": lambda f: test_qwen2_moe._build(f, "api-qwen2", test_qwen2_moe.CONFIG, 71),
        "mixtral": lambda f: test_mixtral._build(f, "api-mixtral", test_mixtral.CONFIG, 72),
        "olmoe": lambda f: test_olmoe._build(f, "api-olmoe", test_olmoe.CONFIG, 73),
        "glm4-moe": lambda f: test_glm4_moe._build(f, "api-glm4", 74),
        "minimax-m2": lambda f: test_minimax_m2._build(f, "api-minimax", 75),
        "deepseek-v3": lambda f: test_deepseek_v3._build(f, "api-ds3", test_deepseek_v3.LORA, 76),
        "deepseek-v2": lambda f: test_deepseek_v2._build(
            f, "api-ds2", test_deepseek_v2.GROUPED, 77
        ),
        "glm4-moe-lite": lambda f: test_glm4_moe_lite._build(
            f, "api-flash", test_glm4_moe_lite.FLASH, 78
        ),
        "gpt-oss": lambda f: test_gpt_oss._build(f, "api-gpt-oss", 79),
        "qwen3-next": lambda f: test_qwen3_next._build(f, "api-next", test_qwen3_next.INTERVAL, 79),
        "qwen3.5-moe": lambda f: test_qwen3_5_moe._build(f, "api-qwen35", 80),
        # the checkpoint as transformers saves it: DeepSeek's own tensor names
        "deepseek-v4": lambda f: test_deepseek_v4._build(f, "api-ds4", test_deepseek_v4.MIXED, 81),
        "glm-5": lambda f: test_glm_moe_dsa._build(f, "api-glm5", test_glm_moe_dsa.SHARED, 82),
    }


FAMILIES = [
    "qwen2-moe",
    "mixtral",
    "olmoe",
    "glm4-moe",
    "minimax-m2",
    "deepseek-v3",
    "deepseek-v2",
    "glm4-moe-lite",
    "gpt-oss",
    "qwen3-next",
    "qwen3.5-moe",
    "deepseek-v4",
    "glm-5",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One server whose store holds a model of every family, and their references."""
    root = tmp_path_factory.mktemp("family-models")
    refs = {}
    for name, build in _families().items():
        path, hf = build(tmp_path_factory)
        for _ in Store(root).plan_create(CreateSpec(name=name, from_=str(path))).run():
            pass
        refs[name] = (path, hf)
    with LiveServer(make_config(root)) as srv, httpx.Client(base_url=srv.url, timeout=300) as c:
        yield c, refs


@pytest.mark.parametrize("name", FAMILIES)
def test_raw_greedy_generation_matches_transformers(server, name):
    http, refs = server
    if name == "minimax-m2":
        from tests.models.test_minimax_m2 import pytestmark

        if pytestmark.args[0]:
            pytest.skip(pytestmark.kwargs["reason"])
    path, hf = refs[name]
    tok = Tokenizer(files_of(path))
    ids = tok.encode(PROMPT)
    out = fixtures.hf_greedy(hf, ids, 32)
    stops = [i for i, t in enumerate(out) if t in tok.eos_ids]
    want = tok.decode(out[: stops[0]] if stops else out)
    r = http.post(
        "/api/generate",
        json={
            "model": name,
            "prompt": PROMPT,
            "raw": True,
            "stream": False,
            "options": {"temperature": 0, "num_predict": 32},
        },
    )
    assert r.status_code == 200, r.text
    assert r.json()["response"] == want
    shown = http.post("/api/show", json={"model": name}).json()["model_info"]
    # the checkpoint's tensors, as GGUF counts them: the parameters and the persistent
    # buffers (a router's correction bias), but those the model file ignores (a vision tower)
    config = json.loads((path / "config.json").read_text())
    ignored = models.load_class(config).ignored
    counted = [t for n, t in hf.state_dict().items() if not ignored(n, config)]
    assert shown["general.parameter_count"] == sum(t.numel() for t in counted)
