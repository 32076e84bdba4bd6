"""Ollama's registry handshake: a Bearer challenge answered with a token request signed by
the user's ed25519 key, against the bundled registry in challenge mode."""

from __future__ import annotations

import base64
import hashlib
import shutil
import stat
import subprocess
import urllib.parse

import pytest

from freetoken.pull import RegistryError, auth, pull_model, push_model
from freetoken.registry.auth import ChallengeAuth
from freetoken.store import Store
from tests.pull.conftest import OPTIONS, make_cfg
from tests.pull.harness import ThreadRegistry
from tests.pull.test_pull import same_files


def test_a_challenge_is_parsed_and_turned_into_a_token_url():
    header = (
        'Bearer realm="https://reg.example/token",service="reg",'
        'scope="repository:library/demo:pull,push"'
    )
    c = auth.Challenge.parse(header)
    assert c == auth.Challenge(
        "https://reg.example/token", "reg", "repository:library/demo:pull,push"
    )
    url = c.token_url(now=1700000000, nonce="abc")
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)
    assert query == {
        "service": ["reg"],
        "scope": ["repository:library/demo:pull,push"],
        "ts": ["1700000000"],
        "nonce": ["abc"],
    }
    assert auth.Challenge.parse('Bearer realm="freetoken"') is None  # a fixed-token registry
    assert auth.Challenge.parse('Basic realm="x"') is None


def test_the_signed_text_is_method_url_and_the_empty_bodys_digest():
    digest = base64.b64encode(hashlib.sha256(b"").hexdigest().encode()).decode()
    assert (
        auth.signed_payload("GET", "http://h/token?x=1")
        == f"GET,http://h/token?x=1,{digest}".encode()
    )


def test_a_key_is_made_once_in_openssh_form_and_signs_verifiably(tmp_path):
    path = tmp_path / "keys" / "id_ed25519"
    key = auth.load_or_create_key(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_text().startswith("-----BEGIN OPENSSH PRIVATE KEY-----")
    pub = (tmp_path / "keys" / "id_ed25519.pub").read_text().split()
    assert pub[0] == "ssh-ed25519" and pub[1] == auth.public_key(key)
    again = auth.load_or_create_key(path)
    assert auth.public_key(again) == auth.public_key(key)
    signature = auth.sign(key, b"data")
    assert signature.startswith(pub[1] + ":")
    assert auth.verify(signature, b"data") == pub[1]
    assert auth.verify(signature, b"other") is None
    assert auth.verify("garbage", b"data") is None


def test_a_key_made_by_ssh_keygen_is_read(tmp_path):
    if not shutil.which("ssh-keygen"):
        pytest.skip("ssh-keygen is not installed")
    path = tmp_path / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    key = auth.load_or_create_key(path)
    assert (tmp_path / "id_ed25519.pub").read_text().split()[1] == auth.public_key(key)


def test_push_and_pull_through_the_challenge(source, tmp_path):
    key_file = tmp_path / "me" / "id_ed25519"
    me = auth.public_key(auth.load_or_create_key(key_file))
    keys = tmp_path / "keys"
    keys.write_text(f"ssh-ed25519 {me} me@here\n")
    with ThreadRegistry(tmp_path / "reg", challenge=ChallengeAuth.from_keys_file(keys)) as reg:
        cfg = make_cfg(tmp_path / "models", reg.url, FREETOKEN_KEY=str(key_file))
        source.copy("tiny", "me/tiny")
        push_model(source, "me/tiny", cfg=cfg, options=OPTIONS)
        pull_model(Store(tmp_path / "models"), "me/tiny", cfg=cfg)
        # another key may pull (any key that signs) but not push
        other = make_cfg(tmp_path / "other", reg.url, FREETOKEN_KEY=str(tmp_path / "o" / "k"))
        pull_model(Store(tmp_path / "other"), "me/tiny", cfg=other)
        with pytest.raises(RegistryError) as e:
            push_model(source, "me/tiny", cfg=other, options=OPTIONS)
        assert e.value.status == 401 and "refused the key" in str(e.value)
        assert str(tmp_path / "o" / "k") + ".pub" in str(e.value)
    same_files(source, Store(tmp_path / "models"), "me/tiny")


def test_the_registry_refuses_bad_token_requests(tmp_path):
    import httpx

    with ThreadRegistry(tmp_path / "reg", challenge=ChallengeAuth()) as reg:
        r = httpx.get(f"{reg.url}/v2/library/demo/manifests/latest")
        assert r.status_code == 401
        challenge = auth.Challenge.parse(r.headers["WWW-Authenticate"])
        assert challenge.realm == f"{reg.url}/token"
        assert challenge.scope == "repository:library/demo:pull"
        url = challenge.token_url()
        key = auth.load_or_create_key(tmp_path / "k")
        # signed for another URL, unsigned, stale
        wrong = auth.sign(key, auth.signed_payload("GET", url + "x"))
        assert httpx.get(url, headers={"Authorization": wrong}).status_code == 401
        assert httpx.get(url).status_code == 401
        stale = challenge.token_url(now=1)
        ok = auth.sign(key, auth.signed_payload("GET", stale))
        assert httpx.get(stale, headers={"Authorization": ok}).status_code == 401
        good = auth.sign(key, auth.signed_payload("GET", url))
        token = httpx.get(url, headers={"Authorization": good}).json()["token"]
        again = httpx.get(
            f"{reg.url}/v2/library/demo/manifests/latest",
            headers={"Authorization": f"Bearer {token}"},
        )
        assert again.status_code == 404  # past the guard: the model is not there
        push = httpx.post(
            f"{reg.url}/v2/library/demo/blobs/uploads/",
            headers={"Authorization": f"Bearer {token}"},
        )
        assert push.status_code == 401 and "pull,push" in push.headers["WWW-Authenticate"]
