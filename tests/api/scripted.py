"""Real models whose greedy output is a chosen text: the format tests' way to make a tiny
random model write a family's markup through the whole stack (tokenizer, engine,
detokenizer, parser, API), with nothing stubbed.

A script is a chain of pieces, each a single token: the prompt's last token (the trigger),
then the pieces the model should write, then the end-of-sequence token. Pieces that are not
tokens yet are added to the tokenizer (as control tokens where `special` says, as real
checkpoints mark their markers). The weights then make the model a chain: the embedding of
each piece is a large vector along its own direction, so the residual stream of every layer
is dominated by it (every block reads its input through a norm, so what a block adds stays
small beside it), and the output head scores the piece's successor along that direction.
Nothing else about the architecture is touched (tables indexed by token, as DeepSeek-V4's
hash routing, only grow with the vocabulary), so any family's checkpoint layout works.

A piece may appear only once in all chains (its successor is fixed); a marker a script
writes twice is written once as its control token and then inside a longer text piece.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken, Tokenizer

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
SCALE = 4000.0  # a piece's embedding, beside layer outputs of norm ~10
LOGIT = 20.0  # the successor's score along the piece's direction


def _token(tok: Tokenizer, text: str, special: bool) -> int:
    if len(tok.encode(text, add_special_tokens=False).ids) != 1:
        tok.add_tokens([AddedToken(text, special=special, normalized=False)])
    ids = tok.encode(text, add_special_tokens=False).ids
    assert len(ids) == 1, f"{text!r} is not one token: {ids}"
    return ids[0]


def script_model(
    path: Path,
    chains: list[list[str]],
    *,
    special: Iterable[str] = (),
    eos: str = "<|im_end|>",
) -> None:
    """Rewrites the Hugging Face directory at `path` so that a prompt ending in a chain's
    first piece is answered greedily with the rest of the chain, then `eos` (which becomes
    the model's end-of-sequence token)."""
    special = set(special)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    ids = [[_token(tok, p, p in special) for p in chain] for chain in chains]
    end = _token(tok, eos, True)
    flat = [i for chain in ids for i in chain]
    assert len(set(flat)) == len(flat) and end not in flat, "a piece appears twice"
    tok.save(str(path / "tokenizer.json"))
    vocab = tok.get_vocab_size()

    weights = load_file(str(path / "model.safetensors"))
    assert HEAD in weights, "the script needs an output head of its own (untied)"
    h = weights[EMBED].shape[1]
    g = torch.Generator().manual_seed(0)
    before = weights[EMBED].shape[0]
    for name in (EMBED, HEAD):
        old = weights[name]
        grown = torch.randn(vocab, h, generator=g, dtype=old.dtype) / h**0.5
        grown[: old.shape[0]] = old
        weights[name] = grown
    for name, old in list(weights.items()):
        # tables indexed by token (DeepSeek-V4's hash routing): the new tokens take rows of
        # old ones
        if not old.is_floating_point() and old.dim() and old.shape[0] == before < vocab:
            rows = torch.randint(0, before, (vocab - before,), generator=g)
            weights[name] = torch.cat([old, old[rows]])
    # orthonormal directions while they fit, random unit ones after
    dirs = torch.linalg.qr(torch.randn(h, max(len(flat), h), generator=g))[0].T
    extra = torch.nn.functional.normalize(torch.randn(len(flat), h, generator=g), dim=1)
    dirs = torch.cat([dirs, extra])[: len(flat)]
    for chain in ids:
        for a, b in zip(chain, [*chain[1:], end], strict=True):
            u = dirs[flat.index(a)]
            weights[EMBED][a] = SCALE * u
            weights[HEAD][b] += LOGIT * u
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})

    config = json.loads((path / "config.json").read_text())
    config.update(vocab_size=vocab, eos_token_id=end)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [end]}))
    tcfg = json.loads((path / "tokenizer_config.json").read_text())
    tcfg["eos_token"] = eos
    (path / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2))
