"""Model names: Ollama's defaults and display forms, and a fuzz showing no name escapes the
store."""

from __future__ import annotations

import random
from pathlib import PurePosixPath

import pytest

from freetoken.store.names import InvalidName, Name, parse_digest


def test_defaults_and_display():
    n = Name.parse("llama3")
    assert (n.host, n.namespace, n.model, n.tag) == (
        "registry.ollama.ai",
        "library",
        "llama3",
        "latest",
    )
    assert n.display == "llama3:latest"
    assert Name.parse("me/m:v1").display == "me/m:v1"
    h = Name.parse("http://127.0.0.1:5000/team/m:q4")
    assert (h.scheme, h.host, h.display) == ("http", "127.0.0.1:5000", "127.0.0.1:5000/team/m:q4")
    assert Name.parse("Team/M").key == Name.parse("team/m:latest").key
    assert Name.parse("m", default_host="reg.example:80").host == "reg.example:80"
    assert parse_digest("sha256-" + "A" * 64) == "sha256:" + "a" * 64


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "..",
        "a/../b",
        "../x",
        "a//b",
        "a/b/c/d",
        "/abs",
        "m:..",
        "m:",
        ":tag",
        "a b",
        "x\x00y",
        "ftp://h/m",
        "m@sha256:zz",
        "-lead",
        "n/..:t",
        "a/b/c:..",
    ],
)
def test_bad_names_are_refused(bad):
    with pytest.raises(InvalidName):
        Name.parse(bad)


def test_fuzz_no_parsed_name_leaves_the_manifest_directory():
    rng = random.Random(0)
    alphabet = "abcXYZ019_.-:/@\\ %\x00~" + "é"
    accepted = 0
    for _ in range(20000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 24)))
        try:
            name = Name.parse(text)
        except InvalidName:
            continue
        accepted += 1
        path = name.manifest_path
        assert not path.is_absolute() and len(path.parts) == 4
        assert all(
            p not in ("", ".", "..") and "/" not in p and "\\" not in p and "\x00" not in p
            for p in path.parts
        )
        assert PurePosixPath("/store").joinpath(path).parts[:2] == ("/", "store")
    assert accepted > 100  # the fuzz reached valid names too
