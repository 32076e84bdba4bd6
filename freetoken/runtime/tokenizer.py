"""The model's tokenizer (tokenizer.json) and the special tokens its configs name."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _Tok


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    def __init__(self, files: dict[str, Path]):
        if "tokenizer.json" not in files:
            raise ValueError("the model has no tokenizer.json")
        self.tok = _Tok.from_file(str(files["tokenizer.json"]))
        added = self.tok.get_added_tokens_decoder().items()
        self._control = frozenset(i for i, t in added if t.special)
        self.config = _read_json(files.get("tokenizer_config.json"))
        gen = _read_json(files.get("generation_config.json"))
        model_cfg = _read_json(files.get("config.json"))
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.chat_template = self.config.get("chat_template")
        if isinstance(self.chat_template, list):  # named templates: take "default"
            named = {t.get("name"): t.get("template") for t in self.chat_template}
            self.chat_template = named.get("default") or next(iter(named.values()), None)
        self.add_bos = bool(self.config.get("add_bos_token", False)) and self.bos_token is not None
        self.eos_ids = self._eos_ids(gen, model_cfg)
        self.generation_defaults = {
            k: gen[k] for k in ("temperature", "top_p", "top_k", "min_p") if k in gen
        }

    def _eos_ids(self, gen: dict, model_cfg: dict) -> frozenset[int]:
        ids: set[int] = set()
        for src in (gen.get("eos_token_id"), model_cfg.get("eos_token_id")):
            if isinstance(src, int):
                ids.add(src)
            elif isinstance(src, list):
                ids.update(int(i) for i in src)
        if self.eos_token is not None:
            tid = self.tok.token_to_id(self.eos_token)
            if tid is not None:
                ids.add(tid)
        return frozenset(ids)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        # Templates write special tokens as text; they are matched as tokens here.
        ids = self.tok.encode(text, add_special_tokens=False).ids
        if self.add_bos and not text.startswith(self.bos_token or "\0"):
            ids = [self.tok.token_to_id(self.bos_token)] + ids
        return ids

    def decode(self, ids: Sequence[int], shown: frozenset[int] = frozenset()) -> str:
        """Control tokens (<|im_start|> ...) are not text, except those in `shown` (a chat
        format's markers, which its parser reads); markup tokens that are not marked special
        (<think>, <tool_call>) always decode, so output parsers can see them."""
        ids = list(ids)
        if shown.isdisjoint(ids):
            return self.tok.decode(ids, skip_special_tokens=True)
        kept = [i for i in ids if i in shown or i not in self._control]
        return self.tok.decode(kept, skip_special_tokens=False)

    def special_ids(self, texts: Sequence[str]) -> frozenset[int]:
        """Ids of tokens whose whole text is one of `texts` (a stop string that is one token)."""
        ids = (self.tok.token_to_id(t) for t in texts)
        return frozenset(i for i in ids if i is not None)


def _read_json(path: Path | None) -> dict:
    if path is None:
        return {}
    return json.loads(Path(path).read_text())
