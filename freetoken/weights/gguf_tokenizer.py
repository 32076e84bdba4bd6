"""The tokenizer files a GGUF file implies, as `tokenizers` files: its vocabulary and merges
as a byte-level BPE with the split its `tokenizer.ggml.pre` names (`gpt2` files), or its
SentencePiece pieces and scores as a BPE whose merges the scores order, with byte fallback
(`llama` files: Mixtral, ERNIE-4.5); the chat template GGUF carries.

Pre-tokenizer names are a table (llama.cpp's names -> the split regex they stand for), not
a branch per name: a tokenizer family added is a row.

A SentencePiece file keeps no merges: llama.cpp joins the adjacent pair whose joined piece
scores highest, again and again. A BPE does the same when its merges are every split of
every piece into two pieces, the piece with the highest score first. Its text is
normalized as llama.cpp's is: spaces to "▁", and one before the text and after each added
token where the file asks for a space prefix.
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
NORMAL, UNKNOWN, CONTROL, USER_DEFINED = 1, 2, 3, 4
SPACE = "\u2581"  # SentencePiece's stand-in for a space


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


def _bpe(kv: dict):
    """A `gpt2` file's byte-level BPE."""
    from tokenizers import Tokenizer, decoders, normalizers
    from tokenizers import models as tmodels

    tokens = list(kv["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in kv.get("tokenizer.ggml.merges") or []]
    tok = Tokenizer(tmodels.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    pre = kv.get("tokenizer.ggml.pre")
    if pre in NORMALIZERS:
        tok.normalizer = getattr(normalizers, NORMALIZERS[pre])()
    tok.pre_tokenizer = pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    return tok


def spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Every split of every normal piece into two pieces, the pieces that score highest
    first (then by id): the order llama.cpp joins pairs in."""
    ids = {t: i for i, t in enumerate(tokens) if types[i] == NORMAL}
    found = []
    for t, i in ids.items():
        for cut in range(1, len(t)):
            left, right = t[:cut], t[cut:]
            if left in ids and right in ids:
                found.append((-scores[i], i, ids[left], left, right))
    return [(left, right) for *_, left, right in sorted(found)]


def _spm(kv: dict):
    """A `llama` (SentencePiece) file's pieces as a BPE with byte fallback."""
    from tokenizers import Tokenizer, decoders, normalizers
    from tokenizers import models as tmodels

    tokens = list(kv["tokenizer.ggml.tokens"])
    types = list(kv.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    scores = list(kv.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
    unk = kv.get("tokenizer.ggml.unknown_token_id")
    unk = unk if unk is not None else next((i for i, t in enumerate(types) if t == UNKNOWN), None)
    model = tmodels.BPE(
        vocab={t: i for i, t in enumerate(tokens)},
        merges=spm_merges(tokens, scores, types),
        unk_token=tokens[unk] if unk is not None else None,
        fuse_unk=True,
        byte_fallback=True,
    )
    tok = Tokenizer(model)
    prefix = bool(kv.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Replace(" ", SPACE)]
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), *steps] if prefix else steps)
    dec = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence([*dec, decoders.Strip(" ", 1, 0)] if prefix else dec)
    return tok


_BUILDERS = {"gpt2": _bpe, "llama": _spm}


def write_tokenizer_files(path: Path, out: Path) -> list[str]:
    """tokenizer.json, tokenizer_config.json and generation_config.json from GGUF metadata."""
    from tokenizers import AddedToken

    kv = metadata(_open(path))
    kind = kv.get("tokenizer.ggml.model")
    if kind not in _BUILDERS:
        raise WeightsError(
            f"{path}: tokenizer {kind!r} is not supported ({', '.join(sorted(_BUILDERS))} are)"
        )
    tok = _BUILDERS[kind](kv)
    tokens = list(kv["tokenizer.ggml.tokens"])
    types = list(kv.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    added = [
        AddedToken(tokens[i], special=ty == CONTROL, normalized=False)
        for i, ty in enumerate(types)
        if ty in (CONTROL, USER_DEFINED)
    ]
    tok.add_special_tokens([t for t in added if t.special])
    tok.add_tokens([t for t in added if not t.special])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    _write_configs(kv, tokens, out)
    return ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]


def _write_configs(kv: dict, tokens: list[str], out: Path) -> None:
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
