"""Creating models from quantized GGUF files: what the store reports, what it refuses."""

from __future__ import annotations

import pytest

from freetoken.store import CreateError
from tests import fixtures
from tests.fixtures_gguf import write_gguf
from tests.ftw.test_quantized import _patch_type

from .conftest import create


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf")
    return path, fixtures.hf_qwen3_moe(path, seed=3)


def test_a_quantized_gguf_is_stored_packed(store, hf, tmp_path):
    gguf = write_gguf(hf[1], hf[0], tmp_path / "m.gguf", "Q8_0")
    statuses = [e["status"] for e in create(store, "q", from_=str(gguf))]
    assert statuses[-1] == "success" and not any("dequantizing" in s for s in statuses)
    assert store.resolve("q").info["file_type"] == "Q8_0"


def test_a_gguf_reports_its_own_file_type(store, hf, tmp_path):
    """llama.cpp's name for the file's mix (general.file_type), as Ollama reports it; not
    where a type was decoded (the FTW no longer holds that mix)."""
    from gguf import LlamaFileType

    kind = int(LlamaFileType.MOSTLY_MXFP4_MOE)
    gguf = write_gguf(hf[1], hf[0], tmp_path / "m.gguf", "MXFP4", file_type=kind)
    create(store, "q", from_=str(gguf))
    assert store.resolve("q").info["file_type"] == "MXFP4_MOE"
    kind = int(LlamaFileType.MOSTLY_Q5_0)
    gguf = write_gguf(hf[1], hf[0], tmp_path / "d.gguf", "Q5_0", file_type=kind)
    create(store, "d", from_=str(gguf))
    assert store.resolve("d").info["file_type"] == "BF16"


def test_types_without_a_kernel_are_decoded_and_the_create_says_so(store, hf, tmp_path):
    gguf = write_gguf(hf[1], hf[0], tmp_path / "m.gguf", "Q5_0")
    statuses = [e["status"] for e in create(store, "q", from_=str(gguf))]
    assert "dequantizing Q5_0 tensors to BF16 (no kernel reads them packed)" in statuses
    assert store.resolve("q").info["file_type"] == "BF16"


def test_a_bad_tensor_is_named_and_nothing_is_stored(store, hf, tmp_path):
    gguf = write_gguf(hf[1], hf[0], tmp_path / "m.gguf", "Q8_0")
    _patch_type(gguf, "blk.1.ffn_up_exps.weight", 77)
    with pytest.raises(CreateError, match="tensor blk.1.ffn_up_exps.weight: unknown GGUF"):
        create(store, "q", from_=str(gguf))
    assert store.list_models() == []
    assert not store.blobs.root.exists() or not any(store.blobs.root.iterdir())


def test_a_split_gguf_is_created_from_any_part(store, hf, tmp_path):
    """Every part is read (named in the request, or found beside the one FROM names), and
    the source it records is all of them; a part missing is a clear error."""
    first = write_gguf(hf[1], hf[0], tmp_path / "m.gguf", "Q8_0", split_max_tensors=12)
    parts = sorted(first.parent.glob("m-*-of-*.gguf"))
    statuses = [e["status"] for e in create(store, "s", from_=str(parts[-1]))]
    assert statuses[-1] == "success"
    model = store.resolve("s")
    assert model.info["file_type"] == "Q8_0"
    local = {p.name: _offered(p) for p in parts}
    assert [e["status"] for e in create(store, "t", local_files=local)][-1] == "success"
    parts[1].unlink()
    with pytest.raises(CreateError, match=f"missing beside it: {parts[1].name}"):
        create(store, "u", from_=str(first))


def _offered(path):
    """The file as a client on this machine names it (`local_files`)."""
    from freetoken.store.create import LocalFile

    st = path.stat()
    return LocalFile(str(path), st.st_size, st.st_mtime_ns)
