import subprocess
import sys


def test_api_and_server_never_import_torch():
    code = (
        "import sys, freetoken.api, freetoken.server, freetoken.server.residency, "
        "freetoken.server.runner, freetoken.store\n"
        "freetoken.api.create_app\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_public_names():
    import freetoken.api
    import freetoken.server
    import freetoken.store

    assert freetoken.api.__all__ == ["create_app", "routes"]
    assert freetoken.server.__all__ == ["BindError", "bind", "serve"]
    for name in freetoken.store.__all__:
        assert hasattr(freetoken.store, name)
