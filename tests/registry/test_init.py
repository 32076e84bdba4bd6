import subprocess
import sys


def test_registry_never_imports_torch():
    code = (
        "import sys, freetoken.registry, freetoken.registry.__main__\n"
        "freetoken.registry.create_app\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr


def test_public_names():
    import freetoken.registry
    import freetoken.registry.app

    assert freetoken.registry.__all__ == ["create_app"]
    assert freetoken.registry.create_app is freetoken.registry.app.create_app
