"""A step's masks: bitmask rows computed on the mask worker while the step runs and applied
to the logits on their device. Each sampled token follows the mask computed after the
token before it was committed, in a batch that mixes free rows, constrained rows, a
grammar that ends early, one that allows nothing and one that fails."""

from __future__ import annotations

import importlib.util
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from freetoken.chat.grammar import Lark, lit
from freetoken.kernels import sample_gpu
from freetoken.runtime import constrain, sampling
from freetoken.runtime.constrain import Constraint, Grammars
from freetoken.runtime.masks import Masker
from freetoken.runtime.sampling import SamplingParams
from freetoken.runtime.sequence import Sequence
from freetoken.runtime.vocab import Vocab
from tests.runtime.engine_util import make_engine

PROMPT = [5, 6, 7, 8]
INTERPRET = (
    os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
)


def _words(allowed: list[set[int] | None], V: int) -> torch.Tensor:
    """Bitmask rows of the allowed ids (None: a free row, all ones)."""
    out = np.zeros((len(allowed), (V + 31) // 32), dtype=np.uint32)
    for r, ids in enumerate(allowed):
        if ids is None:
            out[r] = 0xFFFFFFFF
        for t in ids or ():
            out[r, t >> 5] |= np.uint32(1 << (t & 31))
    return torch.from_numpy(out.view(np.int32))


def _on_device(logits: torch.Tensor, bits: torch.Tensor) -> None:
    """The GPU's kernels, run on the CPU."""
    with torch.inference_mode():
        sampling._mask_device(logits, bits, logits.shape[1])


V = 1000  # not a multiple of 32: the last word is partly past the vocabulary
HALF = set(np.random.default_rng(0).choice(V, V // 2, replace=False).tolist())
ROWS = {
    "few ruled out": set(range(V)) - {3, 40, 41},  # scattered out on the host
    "few allowed": {7, 64, 999},  # kept, the rest filled, on the host
    "half": HALF,  # the whole row passed over
    "free": None,
}


@pytest.mark.parametrize("where", ["host", "device"])
@pytest.mark.parametrize("rows", [list(ROWS), ["half", "few allowed"], ["free", "few ruled out"]])
def test_mask_bits_rules_out_every_clear_bit(rows, where):
    allowed = [ROWS[r] for r in rows]
    logits = torch.randn(len(allowed), V, generator=torch.Generator().manual_seed(0))
    apply = sampling.mask_bits if where == "host" else _on_device
    for _ in range(2):  # the second time on the scratch tensors the first one made
        out = logits.clone()
        apply(out, _words(allowed, V))
        for r, keep in enumerate(allowed):
            if keep is None:
                assert torch.equal(out[r], logits[r])  # a free row is untouched
                continue
            want = torch.full((V,), float("-inf"))
            want[sorted(keep)] = logits[r, sorted(keep)]
            assert torch.equal(out[r], want)


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and triton")
@pytest.mark.parametrize("V", [V, 70])  # 70: past the words (two of them) as well
def test_the_one_kernel_rules_out_what_the_torch_code_does(V):
    allowed = [ROWS[r] for r in ROWS] if V > 100 else [{1, 33}, None]
    bits = _words(allowed, V if V > 100 else 64)
    logits = torch.randn(len(allowed), V, generator=torch.Generator().manual_seed(0))
    want, out = logits.clone(), logits.clone()
    sampling.mask_bits(want, bits)
    sample_gpu.mask_bits(out, bits)
    assert torch.equal(out, want)


def test_mask_bits_rules_out_tokens_past_the_words():
    logits = torch.zeros(1, 70)
    sampling.mask_bits(logits, _words([{1, 33}], 64))  # two words: 64 tokens
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [1, 33]


class Counting:
    """Forces base, base + 1, ... and notes how many tokens it had seen at each plan: the
    mask of token t is right only if it was computed after token t - 1 was committed."""

    matcher = None
    finished = False

    def __init__(self, base: int, size: int):
        self.base, self.vocab, self.seen, self.planned = base, SimpleNamespace(size=size), [], []

    def plan(self):
        self.planned.append(len(self.seen))
        return (self.base + len(self.seen),)

    def advance(self, token: int) -> None:
        self.seen.append(token)


class Nothing(Counting):
    """A mask that allows nothing (the forced token is past the vocabulary)."""

    def plan(self):
        return (self.vocab.size + 64,)


class BrokenMatcher(Counting):
    """A grammar row whose matcher the grammar engine refuses."""

    matcher = object()

    def plan(self):
        return constrain.GRAMMAR


@pytest.fixture(scope="module")
def engine(tiny_model):
    return make_engine(tiny_model[0], max_running=8, num_ctx=256)


@pytest.fixture(scope="module")
def grammars(engine):
    vocab = Vocab.from_tokenizer(engine.tokenizer.tok, engine.model.args.vocab_size)
    return Grammars(vocab, engine.tokenizer.eos_ids)


def _seq(n: int, **params) -> Sequence:
    return Sequence(list(PROMPT), SamplingParams(**{"temperature": 0.0, **params}), n, frozenset())


def _run(engine, seqs):
    for s in seqs:
        engine.submit(s, lambda *_: None)
    for _ in range(300):
        if all(s.is_finished for s in seqs):
            return
        engine.step()
    raise AssertionError("the sequences did not finish")


def test_each_token_follows_the_mask_computed_after_the_token_before(engine, grammars):
    V, n = engine.vocab_size, 30
    solo = _seq(n)
    _run(engine, [solo])
    free, sampled = _seq(n), _seq(n, temperature=1.0, seed=4)
    a, b = _seq(n), _seq(n, temperature=1.0, seed=1)
    a.constraint, b.constraint = Counting(100, V), Counting(200, V)
    ends = _seq(n, temperature=1.0, seed=2)  # its grammar ends long before the others
    literal = Lark().grammar(lit("the cat"))
    ends.constraint = Constraint(grammars.matcher(literal), grammars.vocab, [], grammars.eos_ids)
    empty, broken = _seq(n), _seq(n)
    empty.constraint, broken.constraint = Nothing(0, V), BrokenMatcher(0, V)
    _run(engine, [free, a, ends, empty, b, broken, sampled])
    assert free.output_ids == solo.output_ids  # the other rows' masks never touch it
    for s in (a, b):
        c = s.constraint
        assert s.output_ids == list(range(c.base, c.base + n)), s.output_ids
        assert c.planned == list(range(n))  # one plan per token, each after the one before
    assert ends.finish_reason == "stop" and len(ends.output_ids) < n
    assert engine.tokenizer.decode(ends.output_ids) == "the cat"
    assert empty.finish_reason == "stop" and empty.output_ids == []
    assert broken.finish_reason == "error" and broken.output_ids == []
    assert sampled.finish_reason == "length" and len(sampled.output_ids) == n
    assert engine.kv.pool.num_free == engine.kv.pool.num_pages


def test_a_steps_masks_stay_whole_while_the_next_steps_are_computed():
    # two sets of host rows alternate: the rows a step's copy reads are not the ones the
    # worker writes for the next step
    V, masker = 300, Masker()
    first = masker.start([Counting(7, V)]).wait()
    second = masker.start([Counting(9, V)]).wait()
    assert first.allows(0, 7) and not first.allows(0, 9)
    assert second.allows(0, 9) and not second.allows(0, 7)
    assert first.mask(0).allowed().tolist() == [7]


def test_a_step_that_never_waited_leaves_the_next_steps_masks_alone():
    # a step that fails after starting its masks: its result is not the next step's
    V, masker = 300, Masker()
    masker.start([Counting(7, V)])
    second = masker.start([Counting(9, V)]).wait()
    assert second.allows(0, 9) and not second.allows(0, 7)
