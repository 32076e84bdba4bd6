"""The tokenizer files a GGUF file implies: its vocabulary and merges as a `tokenizers`
byte-level BPE, with the split its `tokenizer.ggml.pre` names and the chat template GGUF
carries.

Pre-tokenizer names are a table (llama.cpp's names -> the split regex they stand for), not
a branch per name: a tokenizer family added is a row.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from freetoken.weights import WeightsError
from freetoken.weights.gguf_file import _open, metadata

log = logging.getLogger(__name__)

# The split of the Qwen2/Qwen3 tokenizers (llama.cpp's regex for them).
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre -> the regex split before byte-level encoding; None: GPT-2's own split
PRE_TOKENIZERS: dict[str | None, str | None] = {
    None: None,
    "default": None,
    "gpt-2": None,
    "gpt2": None,
    "qwen2": _QWEN2_SPLIT,
    "qwen35": _QWEN2_SPLIT,
    "deepseek-llm": _QWEN2_SPLIT,
}


# tokenizer.ggml.pre -> the Unicode normalization the family's tokenizer.json applies
# first (Qwen's composes: "e" + a combining accent is one "é" before the split)
NORMALIZERS: dict[str | None, str] = {"qwen2": "NFC", "qwen35": "NFC"}

# tokenizer.ggml.token_type values (llama.cpp's): control tokens are not text; user-defined
# ones are added tokens matched whole but decoded as text (<think>, <tool_call>), as the
# checkpoint's tokenizer.json has them ("special": false)
CONTROL, USER_DEFINED = 3, 4


def pre_tokenizer(pre: str | None):
    from tokenizers import Regex, pre_tokenizers

    if pre not in PRE_TOKENIZERS:
        log.warning("GGUF pre-tokenizer %r is not known; using the GPT-2 split", pre)
    split = PRE_TOKENIZERS.get(pre)
    if split is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def write_tokenizer_files(path: Path, out: Path) -> list[str]:
    """tokenizer.json, tokenizer_config.json and generation_config.json from GGUF metadata."""
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers
    from tokenizers import models as tmodels

    kv = metadata(_open(path))
    if kv.get("tokenizer.ggml.model") != "gpt2":
        raise WeightsError(
            f"{path}: tokenizer {kv.get('tokenizer.ggml.model')!r} is not supported (gpt2 BPE is)"
        )
    tokens = list(kv["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in kv.get("tokenizer.ggml.merges") or []]
    tok = Tokenizer(tmodels.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    pre = kv.get("tokenizer.ggml.pre")
    if pre in NORMALIZERS:
        tok.normalizer = getattr(normalizers, NORMALIZERS[pre])()
    tok.pre_tokenizer = pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    types = list(kv.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    added = [
        AddedToken(tokens[i], special=ty == CONTROL, normalized=False)
        for i, ty in enumerate(types)
        if ty in (CONTROL, USER_DEFINED)
    ]
    tok.add_special_tokens([t for t in added if t.special])
    tok.add_tokens([t for t in added if not t.special])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    ids = {k: kv.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos")}
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokens[ids["bos"]]
        if ids["bos"] is not None and kv.get("tokenizer.ggml.add_bos_token")
        else None,
        "eos_token": tokens[ids["eos"]] if ids["eos"] is not None else None,
        "add_bos_token": bool(kv.get("tokenizer.ggml.add_bos_token", False)),
        "chat_template": kv.get("tokenizer.chat_template"),
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    gen = {"eos_token_id": [int(ids["eos"])]} if ids["eos"] is not None else {}
    (out / "generation_config.json").write_text(json.dumps(gen))
    return ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]
