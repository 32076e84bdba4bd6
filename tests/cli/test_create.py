import hashlib
import io
import json

import httpx
import pytest

from freetoken.cli.client import Client
from freetoken.cli.create import build_request, create, model_files, resolve_path
from freetoken.cli.errors import CommandError, ServerError
from freetoken.cli.progress import Progress

from .conftest import ndjson


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@pytest.fixture
def model_dir(tmp_path):
    """tmp/project/Modelfile and tmp/project/weights/ with an HF-style directory."""
    project = tmp_path / "project"
    weights = project / "weights"
    weights.mkdir(parents=True)
    files = {
        "config.json": b'{"model_type": "qwen3_moe"}',
        "model.safetensors": b"\x00" * 1000,
        "tokenizer.json": b"{}",
        "tokenizer_config.json": b"{}",
        "merges.txt": b"a b",
        "chat_template.jinja": b"{{ messages }}",
        "README.md": b"not a model file",
        ".hidden.json": b"{}",
    }
    for name, data in files.items():
        (weights / name).write_bytes(data)
    (weights / "original").mkdir()
    (weights / "original" / "consolidated.safetensors").write_bytes(b"skip me")
    return project, files


def blobs_present(api, present: set[str]):
    def head(request):
        digest = request.url.path.rsplit("/", 1)[1]
        return httpx.Response(200 if digest in present else 404)

    def post(request):
        assert sha(request.content) == request.url.path.rsplit("/", 1)[1]
        present.add(request.url.path.rsplit("/", 1)[1])
        return httpx.Response(201)

    for digest in {
        sha(b)
        for b in (
            b'{"model_type": "qwen3_moe"}',
            b"\x00" * 1000,
            b"{}",
            b"a b",
            b"{{ messages }}",
            b"GGUF...",
        )
    }:
        api.on("HEAD", f"/api/blobs/{digest}", head)
        api.on("POST", f"/api/blobs/{digest}", post)


def write_modelfile(project, text):
    path = project / "Modelfile"
    path.write_text(text)
    return path


def test_from_directory_is_relative_to_the_modelfile(api, client, model_dir, monkeypatch, tmp_path):
    project, files = model_dir
    monkeypatch.chdir(tmp_path)  # not the Modelfile's directory
    mf = write_modelfile(
        project,
        'FROM ./weights\nPARAMETER temperature 0\nPARAMETER stop "<|im_end|>"\n'
        'SYSTEM """You are terse."""\nMESSAGE user hi\nLICENSE MIT\n',
    )
    blobs_present(api, set())
    request = build_request(client, "demo", mf, Progress(io.StringIO(), tty=False))
    expected = {
        n: sha(files[n])
        for n in (
            "chat_template.jinja",
            "config.json",
            "merges.txt",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
        )
    }
    assert request == {
        "model": "demo",
        "files": expected,
        "system": "You are terse.",
        "parameters": {"temperature": 0.0, "stop": ["<|im_end|>"]},
        "messages": [{"role": "user", "content": "hi"}],
        "license": "MIT",
    }


def test_blob_upload_is_skipped_when_the_server_has_it(api, client, model_dir):
    project, files = model_dir
    mf = write_modelfile(project, "FROM weights\n")
    present = {sha(files["model.safetensors"])}
    blobs_present(api, present)
    out = io.StringIO()
    build_request(client, "demo", mf, Progress(out, tty=False))
    uploaded = [r.url.path for r in api.requests if r.method == "POST"]
    assert f"/api/blobs/{sha(files['model.safetensors'])}" not in uploaded
    assert f"/api/blobs/{sha(files['config.json'])}" in uploaded
    # tokenizer.json and tokenizer_config.json share a digest: the second one finds it present.
    assert len(uploaded) == 4
    lines = out.getvalue().splitlines()
    assert lines[0] == "gathering model components"
    assert f"copying file {sha(files['model.safetensors'])} 100%" in lines


def test_from_gguf_file(api, client, tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF...")
    mf = write_modelfile(tmp_path, "FROM ./m.gguf\n")
    blobs_present(api, set())
    request = build_request(client, "g", mf, Progress(io.StringIO(), tty=False))
    assert request == {"model": "g", "files": {"m.gguf": sha(b"GGUF...")}}


def test_from_model_name(api, client, tmp_path):
    mf = write_modelfile(tmp_path, "FROM qwen3:30b\nTEMPLATE {{ .Prompt }}\n")
    request = build_request(client, "mine", mf, Progress(io.StringIO(), tty=False), quantize="q8_0")
    assert request == {
        "model": "mine",
        "from": "qwen3:30b",
        "template": "{{ .Prompt }}",
        "quantize": "q8_0",
    }
    assert not [r for r in api.requests if "/api/blobs" in r.url.path]


def test_missing_from_path_names_the_path(client, tmp_path):
    mf = write_modelfile(tmp_path, "FROM ./nowhere\n")
    with pytest.raises(CommandError, match=r"path '.*nowhere' does not exist"):
        build_request(client, "x", mf, Progress(io.StringIO(), tty=False))


def test_missing_modelfile(client, tmp_path):
    with pytest.raises(CommandError, match="Modelfile '.*' not found"):
        build_request(client, "x", tmp_path / "Modelfile", Progress(io.StringIO(), tty=False))


def test_bad_modelfile_reports_the_line(client, tmp_path):
    mf = write_modelfile(tmp_path, "FROM x\nPARAMETER nonsense 1\n")
    with pytest.raises(CommandError, match="line 2"):
        build_request(client, "x", mf, Progress(io.StringIO(), tty=False))


def test_model_files_skips_hidden_files_and_subdirectories(model_dir):
    project, _ = model_dir
    names = [p.name for p in model_files(project / "weights")]
    assert names == [
        "chat_template.jinja",
        "config.json",
        "merges.txt",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]


def test_model_files_of_an_ftw_directory_include_its_shards(tmp_path):
    # issue 22: the shards (ftw-NNNNN.bin) were left behind and the create failed
    for name in ("ftw.json", "ftw-00000.bin", "ftw-00001.bin", "config.json", "notes.bin"):
        (tmp_path / name).write_bytes(b"x")
    names = [p.name for p in model_files(tmp_path)]
    assert names == ["config.json", "ftw-00000.bin", "ftw-00001.bin", "ftw.json"]


def test_resolve_path_prefers_an_existing_path(tmp_path):
    (tmp_path / "demo").mkdir()
    assert resolve_path("demo", tmp_path) == tmp_path / "demo"
    assert resolve_path("library/demo:latest", tmp_path) is None


def test_create_streams_server_statuses(api, client, tmp_path):
    mf = write_modelfile(tmp_path, "FROM base\n")
    api.on(
        "POST",
        "/api/create",
        ndjson(
            {"status": "using existing layer sha256:ab"},
            {"status": "writing manifest"},
            {"status": "success"},
        ),
    )
    out = io.StringIO()
    create(client, "mine", mf, Progress(out, tty=False))
    assert out.getvalue().splitlines() == [
        "gathering model components",
        "using existing layer sha256:ab",
        "writing manifest",
        "success",
    ]
    assert api.bodies("POST", "/api/create") == [{"model": "mine", "from": "base"}]
    assert json.loads(api.requests[-1].content)["model"] == "mine"


def local_client(api):
    return Client("http://127.0.0.1:11434", transport=httpx.MockTransport(api))


@pytest.mark.parametrize(
    "url, local",
    [
        ("http://127.0.0.1:11434", True),
        ("http://127.8.0.1:80", True),
        ("http://localhost:11434", True),
        ("http://[::1]:11434", True),
        ("http://10.0.0.2:11434", False),
        ("https://models.example.com", False),
    ],
)
def test_a_loopback_server_is_on_this_machine(url, local):
    assert Client(url).is_local is local


def test_a_server_on_this_machine_is_offered_the_files_in_place(api, model_dir):
    project, files = model_dir
    mf = write_modelfile(project, "FROM ./weights\n")
    request = build_request(local_client(api), "demo", mf, Progress(io.StringIO(), tty=False))
    weights = project / "weights"
    assert request["model"] == "demo" and "files" not in request
    assert request["local_files"]["model.safetensors"] == {
        "path": str(weights / "model.safetensors"),
        "size": 1000,
        "mtime_ns": (weights / "model.safetensors").stat().st_mtime_ns,
    }
    assert sorted(request["local_files"]) == [p.name for p in model_files(weights)]
    assert not [r for r in api.requests if "/api/blobs" in r.url.path]  # nothing uploaded


def test_files_the_server_cannot_read_are_uploaded(api, model_dir):
    project, files = model_dir
    mf = write_modelfile(project, "FROM ./weights\n")
    blobs_present(api, set())

    def create_route(request):
        if "local_files" in json.loads(request.content):
            return httpx.Response(412, json={"error": "the server cannot see /x: No such file"})
        return ndjson({"status": "success"})

    api.on("POST", "/api/create", create_route)
    out = io.StringIO()
    create(local_client(api), "demo", mf, Progress(out, tty=False))
    first, second = api.bodies("POST", "/api/create")
    assert "local_files" in first and "files" not in first
    assert second["files"]["model.safetensors"] == sha(files["model.safetensors"])
    assert "local_files" not in second
    assert "uploading: the server cannot see /x" in out.getvalue()
    assert out.getvalue().rstrip().endswith("success")


def test_other_errors_of_an_in_place_create_are_not_retried(api, model_dir):
    project, _ = model_dir
    mf = write_modelfile(project, "FROM ./weights\n")
    api.on("POST", "/api/create", httpx.Response(400, json={"error": "unknown parameter"}))
    with pytest.raises(ServerError, match="unknown parameter"):
        create(local_client(api), "demo", mf, Progress(io.StringIO(), tty=False))
    assert len(api.bodies("POST", "/api/create")) == 1


def test_a_part_of_a_split_gguf_brings_every_part(api, tmp_path):
    """FROM names one part of llama.cpp's gguf-split files: all of them are offered (or
    uploaded); one missing is said before anything is sent."""
    names = [f"big-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    for name in names:
        (tmp_path / name).write_bytes(b"GGUF" + name.encode())
    mf = write_modelfile(tmp_path, f"FROM ./{names[1]}\n")
    request = build_request(local_client(api), "big", mf, Progress(io.StringIO(), tty=False))
    assert sorted(request["local_files"]) == names
    (tmp_path / names[2]).unlink()
    with pytest.raises(CommandError, match=f"missing beside it: {names[2]}"):
        build_request(local_client(api), "big", mf, Progress(io.StringIO(), tty=False))
    assert not [r for r in api.requests if "/api/blobs" in r.url.path]  # nothing uploaded
