"""`freetoken bench draw`: its rows on a GPU, and a clear refusal without one."""

from __future__ import annotations

import pytest
import torch

from freetoken.bench import draw


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_without_a_gpu_it_says_so():
    with pytest.raises(SystemExit, match="no CUDA device"):
        draw.main(["--draws", "10"])


def test_unknown_options_are_named(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(SystemExit, match="unknown options 'nucleus'"):
        draw.main(["--options", "nucleus"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_rows_time_the_kernels_against_torch(capsys):
    draw.main(["--vocab", "32000", "--rows", "1,2", "--draws", "20", "--options", "hot,uniform"])
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.strip().startswith(("hot", "uniform"))]
    assert len(lines) == 4
    got = draw.measure(32000, 1, draw.OPTIONS["uniform"], 20, torch.device("cuda"))
    assert got["queued_us"] > 0 and got["torch_us"] > 0
    assert got["speedup"] == pytest.approx(got["torch_us"] / got["queued_us"])
