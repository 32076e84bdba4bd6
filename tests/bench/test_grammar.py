"""`freetoken bench grammar` on a small vocabulary (CPU): a mask row per grammar along a walk
its own mask allows (the bench stops otherwise), and a decode row per mode against free."""

import json

from freetoken.bench import grammar


def test_rows_for_every_grammar_and_every_decode_mode(capsys, tmp_path):
    grammar.main(
        ["--vocab", "4000", "--tokens", "6", "--repeats", "1", "--work", str(tmp_path), "--json"]
    )
    rows = [json.loads(l) for l in capsys.readouterr().out.splitlines() if l.startswith("{")]
    masks = [r for r in rows if "grammar" in r]
    assert [r["grammar"] for r in masks] == [
        "json schema",
        "forced call",
        "auto (text, then a call)",
    ]
    for r in masks:
        assert r["tokens"] > 10 and 0 < r["p50_us"] <= r["max_us"] and r["compile_ms"] > 0
    decode = {r["mode"]: r for r in rows if "mode" in r}
    assert set(decode) == {"free", "auto", "json"} and decode["free"]["ratio"] == 1.0
    assert all(r["tok_s"] > 0 and r["tokens"] == 6 for r in decode.values())
