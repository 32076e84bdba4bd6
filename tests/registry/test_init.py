import subprocess
import sys


def test_registry_never_imports_torch():
    code = (
        "import sys, registry, registry.__main__\n"
        "registry.create_app\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr


def test_public_names():
    import registry
    import registry.app

    assert registry.__all__ == ["create_app"]
    assert registry.create_app is registry.app.create_app
