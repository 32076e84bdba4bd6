"""Which format a model has: its architecture's, else its template's markers', else Qwen's."""

from __future__ import annotations

import pytest

from freetoken import models
from freetoken.chat import formats
from freetoken.chat.formats import (
    DeepSeekFormat,
    DsmlFormat,
    GlmFormat,
    GraniteFormat,
    HarmonyFormat,
    MiniMaxFormat,
    MistralFormat,
    QwenFormat,
)
from freetoken.tools import synth


@pytest.mark.parametrize(
    "architecture, cls",
    [
        ("deepseek_v3", DeepSeekFormat),
        ("deepseek_v2", DeepSeekFormat),
        ("deepseek_v4", DsmlFormat),
        ("glm4_moe", GlmFormat),
        ("glm4_moe_lite", GlmFormat),
        ("glm_moe_dsa", GlmFormat),
        ("minimax_m2", MiniMaxFormat),
        ("mixtral", MistralFormat),
        ("gpt_oss", HarmonyFormat),
        ("granitemoe", GraniteFormat),
    ],
)
def test_the_architecture_declares_the_format_whatever_the_template(architecture, cls):
    assert type(formats.format_for(architecture, synth.CHAT_TEMPLATE)) is cls
    assert type(formats.format_for(architecture, None)) is cls


def test_every_architecture_that_is_not_claimed_is_read_from_its_template():
    unclaimed = set(models.ARCHITECTURES) - set(formats.BY_ARCHITECTURE)
    qwen = {"qwen3_moe", "qwen2_moe", "qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text"}
    qwen |= {"qwen3_vl_moe"}
    assert unclaimed == qwen | {"olmoe", "ernie4_5_moe", "dots1"}


@pytest.mark.parametrize(
    "template, cls",
    [
        (synth.CHAT_TEMPLATE, QwenFormat),
        (None, QwenFormat),
        ("{{ '<|start|>assistant<|channel|>final<|message|>' }}", HarmonyFormat),
        ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>", DeepSeekFormat),
        ('<｜DSML｜tool_calls>\n<｜DSML｜invoke name="', DsmlFormat),
        ("<minimax:tool_call><invoke", MiniMaxFormat),
        ("<tool_call>{{ name }}<arg_key>", GlmFormat),
        ("[TOOL_CALLS]", MistralFormat),
    ],
)
def test_a_template_shows_the_format_of_an_unclaimed_architecture(template, cls):
    assert type(formats.format_for("qwen3_moe", template)) is cls
    assert type(formats.format_for(None, template)) is cls


def test_qwen_parses_only_the_markers_its_template_shows():
    assert formats.format_for("qwen3_moe", "plain {{ messages }}") == QwenFormat(
        None, None, None, None
    )
    assert formats.format_for("qwen3_moe", synth.CHAT_TEMPLATE) == QwenFormat(
        think_open=None, think_close=None
    )


def test_every_format_declares_its_markers():
    for cls in formats.FORMATS:
        assert cls.markers and cls.name
        assert set(cls.markers) <= set(formats.MARKERS)
