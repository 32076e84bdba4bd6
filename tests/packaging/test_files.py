"""The service unit and the container file say what the README says they do."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_unit_runs_serve_as_a_service_user_with_the_store_under_var_lib():
    lines = (ROOT / "packaging/freetoken.service").read_text().splitlines()
    keys = [line.split("=", 1) for line in lines if "=" in line and not line.startswith("#")]
    exec_start = [v for k, v in keys if k == "ExecStart"]
    assert len(exec_start) == 1 and exec_start[0].endswith("/bin/freetoken serve")
    assert ["User", "freetoken"] in keys and ["LimitMEMLOCK", "infinity"] in keys
    assert ["Environment", '"FREETOKEN_MODELS=/var/lib/freetoken/models"'] in keys
    assert ["WantedBy", "multi-user.target"] in keys


def test_the_container_file_has_cuda_the_store_as_a_volume_and_the_port():
    lines = [
        line.strip()
        for line in (ROOT / "packaging/Containerfile").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert lines[0].startswith("FROM nvidia/cuda:")
    text = "\n".join(lines)
    assert "packaging/install.sh" in text and "--torch cuda" in text
    assert "VOLUME /var/lib/freetoken" in lines and "EXPOSE 11434" in lines
    assert 'ENTRYPOINT ["freetoken"]' in lines and 'CMD ["serve"]' in lines
