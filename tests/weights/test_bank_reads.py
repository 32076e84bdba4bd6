import pytest
import torch
from safetensors.torch import save_file

from freetoken.models.base import ExpertKey
from freetoken.weights import bank_reads
from freetoken.weights.experts import assemble

E, I, H = 6, 5, 8


def _checkpoint(tmp_path, dtype, halves=True, files=2):
    """Per-expert pieces spread over `files` safetensors files (with an unrelated tensor
    between them), their keys, and the bank the general path assembles from them."""
    torch.manual_seed(0)
    pieces, tensors = [], [{} for _ in range(files)]
    for e in range(E):
        for half in (0, 1) if halves else (None,):
            name = f"layers.0.experts.{e}.{half}.weight"
            t = torch.randn(I if halves else 2 * I, H).to(dtype)
            tensors[(e + (half or 0)) % files][name] = t
            tensors[e % files][f"other.{e}.{half}"] = torch.randn(3)
            pieces.append((name, t, ExpertKey(0, "gate_up", e, half)))
    stored = {}
    for i, ts in enumerate(tensors):
        path = tmp_path / f"m{i}.safetensors"
        save_file(ts, str(path))
        stored |= bank_reads.header(path)
    expected = assemble([(t, k) for _, t, k in pieces], E, "test")
    return [(stored[n], k) for n, _, k in pieces], expected


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("halves", [True, False])
def test_read_in_place_equals_the_assembled_bank(tmp_path, dtype, halves):
    pieces, expected = _checkpoint(tmp_path, dtype, halves)
    bank = bank_reads.read_bank(pieces[::-1], E, None)  # any order of pieces
    assert bank is not None and bank.dtype == dtype
    assert torch.equal(bank, expected)
    assert torch.equal(bank_reads.read_bank(pieces, E, dtype), expected)


def test_pieces_that_need_changing_take_the_general_path(tmp_path):
    pieces, _ = _checkpoint(tmp_path, torch.bfloat16)
    s0, k0 = pieces[0]
    other = ExpertKey(k0.layer, k0.bank, k0.expert, k0.half, transposed=True)
    cases = {
        "converted dtype": (pieces, torch.float32),
        "transposed": ([(s0, other), *pieces[1:]], None),
        "an expert missing": (pieces[:-1], None),
        "a piece twice": ([*pieces[:-1], pieces[0]], None),
        "an expert out of range": ([*pieces[:-1], (s0, ExpertKey(0, "gate_up", E, 1))], None),
        "no pieces": ([], None),
    }
    for why, (ps, dtype) in cases.items():
        assert bank_reads.read_bank(ps, E, dtype) is None, why


def test_a_file_cut_short_is_an_error(tmp_path):
    pieces, _ = _checkpoint(tmp_path, torch.float32, files=1)
    path = pieces[0][0].path
    last = max(s.offset + s.nbytes for s, _ in pieces)
    with open(path, "r+b") as f:
        f.truncate(last - 4)
    with pytest.raises(OSError, match="ends inside"):
        bank_reads.read_bank(pieces, E, None)
