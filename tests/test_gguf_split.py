"""freetoken/gguf_split.py: a split GGUF's parts from any one of them."""

from __future__ import annotations

import pytest

from freetoken import gguf_split


def test_part_names_follow_gguf_split_s_naming():
    assert gguf_split.part_names("Big-Q4_K_M-00002-of-00003.gguf") == [
        "Big-Q4_K_M-00001-of-00003.gguf",
        "Big-Q4_K_M-00002-of-00003.gguf",
        "Big-Q4_K_M-00003-of-00003.gguf",
    ]
    for whole in ("model.gguf", "m-1-of-3.gguf", "m-00004-of-00003.gguf", "m-00001-of-00002.bin"):
        assert gguf_split.part_names(whole) is None


def test_parts_are_found_beside_the_named_one_or_named_as_missing(tmp_path):
    whole = tmp_path / "model.gguf"
    assert gguf_split.parts(whole) == [whole]
    names = gguf_split.part_names("m-00001-of-00003.gguf")
    for name in names[:2]:
        (tmp_path / name).write_bytes(b"GGUF")
    with pytest.raises(gguf_split.MissingParts, match="missing beside it: m-00003-of-00003.gguf"):
        gguf_split.parts(tmp_path / names[1])
    (tmp_path / names[2]).write_bytes(b"GGUF")
    assert gguf_split.parts(tmp_path / names[2]) == [tmp_path / n for n in names]


def test_first_of_only_a_whole_split():
    names = gguf_split.part_names("m-00001-of-00002.gguf")
    assert gguf_split.first_of(reversed(names)) == names[0]
    assert gguf_split.first_of(names[:1]) is None  # one part of two
    assert gguf_split.first_of([*names, "other.gguf"]) is None
    assert gguf_split.first_of(["model.gguf"]) is None and gguf_split.first_of([]) is None
