import json

import pytest

from freetoken.store import CreateError, CreateSpec, InvalidName, ModelNotFound

from .conftest import create, write_model_dir


def test_from_directory_reports_progress_and_ends_with_success(store, model_dir):
    events = create(store, "tiny", from_=str(model_dir))
    statuses = [e["status"] for e in events]
    assert statuses[-2:] == ["writing manifest", "success"]
    assert "converting model" in statuses
    assert any(
        e.get("total") and e.get("completed") == e["total"]
        for e in events
        if e["status"] == "converting model"
    )
    assert any(s.startswith("creating new layer sha256:") for s in statuses)
    # the store holds FTW, not the checkpoint it was made from
    assert set(store.resolve("tiny").files) == {
        "ftw.json",
        "ftw-00000.bin",
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    }
    again = [e["status"] for e in create(store, "tiny2", from_=str(model_dir))]
    assert not any(s.startswith("creating new layer") for s in again[:-3])


def test_from_uploaded_files(store, model_dir):
    files = {p.name: store.blobs.put_file(p)[0] for p in model_dir.iterdir() if p.suffix != ".md"}
    events = create(store, "up", files=files, parameters={"temperature": "0.5"})
    assert events[-1] == {"status": "success"}
    view = store.resolve("up")
    assert "ftw.json" in view.files and "model.safetensors" not in view.files
    assert view.params == {"temperature": 0.5}


def test_from_model_inherits_and_overrides(store, model_dir):
    create(
        store,
        "base",
        from_=str(model_dir),
        system="old",
        parameters={"temperature": 0.1, "top_k": 5},
        messages=[{"role": "user", "content": "a"}],
    )
    create(
        store,
        "child",
        from_="base",
        system="new",
        parameters={"temperature": 0.9},
        template="{{ messages }}",
        license=["L1", "L2"],
    )
    base, child = store.resolve("base"), store.resolve("child")
    assert child.files == base.files
    assert child.system == "new" and child.template == "{{ messages }}"
    assert child.params == {"temperature": 0.9, "top_k": 5}
    assert child.messages == base.messages and child.licenses == ["L1", "L2"]
    assert child.details["parent_model"] == "base:latest"


def test_sharded_safetensors_need_every_shard(store, tmp_path):
    d = write_model_dir(tmp_path / "sharded")
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    index = {
        "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
        }
    }
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CreateError, match="model-00002-of-00002.safetensors, which is missing"):
        store.plan_create(CreateSpec("m", from_=str(d)))
    (d / "model-00002-of-00002.safetensors").write_bytes(b"\0" * 8)  # present, but not safetensors
    with pytest.raises(CreateError, match="converting sharded to FTW failed: .*header"):
        create(store, "m", from_=str(d))
    assert store.list_models() == []


@pytest.mark.parametrize(
    "fields, message",
    [
        ({}, "neither 'from' or 'files' was specified"),
        ({"from_": "/no/such/dir"}, "directory '/no/such/dir' does not exist"),
        ({"files": {"../config.json": "sha256:" + "0" * 64}}, "paths must be relative"),
        ({"files": {"config.json": "sha256:" + "0" * 64}}, f'blob "sha256:{"0" * 64}" not found'),
        ({"files": {"config.json": "nope"}}, "invalid digest"),
        ({"from_": "x", "parameters": {"no_such_option": 1}}, "unknown parameter 'no_such_option'"),
    ],
)
def test_bad_requests(store, model_dir, fields, message):
    create(store, "x", from_=str(model_dir))
    with pytest.raises(CreateError, match=message.replace("(", r"\(")):
        store.plan_create(CreateSpec("y", **fields))


def test_directory_without_config_names_the_path(store, tmp_path):
    d = tmp_path / "just some files"
    d.mkdir()
    (d / "notes.txt").write_text("hi")
    with pytest.raises(CreateError) as e:
        store.plan_create(CreateSpec("x", from_=str(d)))
    assert str(d) in str(e.value) and "config.json" in str(e.value)


def test_directory_without_weights(store, model_dir):
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(CreateError, match="has no weights"):
        store.plan_create(CreateSpec("x", from_=str(model_dir)))


def test_a_file_is_not_a_model_directory(store, model_dir):
    with pytest.raises(CreateError, match="is not a directory"):
        store.plan_create(CreateSpec("x", from_=str(model_dir / "config.json")))


def test_unknown_architecture_lists_supported_ones(store, tmp_path):
    d = write_model_dir(tmp_path / "llama", model_type="llama")
    with pytest.raises(
        CreateError, match=r"unsupported model_type 'llama' \(supported: .*qwen3_moe"
    ):
        store.plan_create(CreateSpec("x", from_=str(d)))


def test_a_quantized_checkpoint_of_an_unread_kind_fails_clearly(store, tmp_path):
    d = write_model_dir(tmp_path / "gptq", quantization_config={"quant_method": "gptq"})
    with pytest.raises(
        CreateError, match="gptq-quantized .*not supported .FP8, MXFP4 and ModelOpt NVFP4 are"
    ):
        create(store, "x", from_=str(d))
    assert store.list_models() == []


def test_wrong_parameter_type(store, model_dir):
    with pytest.raises(CreateError, match="temperature"):
        store.plan_create(CreateSpec("x", from_=str(model_dir), parameters={"temperature": "hot"}))


def test_unknown_base_model_and_bad_name(store):
    with pytest.raises(ModelNotFound):
        store.plan_create(CreateSpec("x", from_="missing"))
    with pytest.raises(InvalidName):
        store.plan_create(CreateSpec("bad name!", from_="missing"))


def test_relative_and_home_paths_count_as_directories(store, model_dir, monkeypatch):
    monkeypatch.chdir(model_dir.parent)
    create(store, "rel", from_="./" + model_dir.name)
    assert store.resolve("rel")


def test_bad_gguf_files_fail_clearly(store, model_dir, tmp_path):
    (model_dir / "a.gguf").write_bytes(b"GGUF")
    (model_dir / "b.gguf").write_bytes(b"GGUF")
    with pytest.raises(CreateError, match="more than one GGUF"):
        store.plan_create(CreateSpec("x", from_=str(model_dir)))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF not really")
    with pytest.raises(
        CreateError, match="converting broken.gguf to FTW failed: .*not a readable GGUF"
    ):
        create(store, "x", from_=str(bad))
    assert store.list_models() == []
    assert not any(p.name.startswith(".convert-") for p in store.root.iterdir())


def test_an_interrupted_create_publishes_nothing(store, model_dir):
    run = store.plan_create(CreateSpec("x", from_=str(model_dir))).run()
    for event in run:
        if event["status"] == "converting model":
            break
    run.close()  # the client went away mid-conversion
    assert store.list_models() == []
    assert not any(p.name.startswith("partial-") for p in store.blobs.root.iterdir())
    assert not any(p.name.startswith(".convert-") for p in store.root.iterdir())
