"""The Modelfile shipped for each supported family parses, names a directory to build from,
and sets only options Ollama knows, with values of their types."""

from __future__ import annotations

from pathlib import Path

import pytest

from freetoken import models
from freetoken import options as opts
from freetoken.store import modelfile

FOLDER = Path(__file__).resolve().parents[2] / "modelfiles"


def test_every_supported_family_has_a_modelfile():
    assert {p.stem for p in FOLDER.glob("*.Modelfile")} >= set(models.ARCHITECTURES)


@pytest.mark.parametrize("path", sorted(FOLDER.glob("*.Modelfile")), ids=lambda p: p.stem)
def test_modelfile_parses_with_known_parameters(path):
    mf = modelfile.parse(path.read_text())
    assert mf.from_.startswith("./")  # a placeholder for the user's checkpoint
    for name, value in mf.parameters.items():
        assert name in opts.OPTION_TYPES, name
        opts.coerce(name, value, from_text=isinstance(value, str))
