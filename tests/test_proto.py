"""The contract: committed stubs are fresh, buf lint passes, the wheel has them."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import (
    ROOT,
    START_SECONDS,
    require_tool,
)

_spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
assert _spec is not None
assert _spec.loader is not None
gen_protos = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen_protos)


@pytest.mark.parametrize(
    ("committed_root", "py_package"),
    list(gen_protos.TARGETS.items()),
    ids=["server", "python-client"],
)
def test_committed_stubs_match_the_protos(
    tmp_path: Path, committed_root: Path, py_package: str
) -> None:
    # The daemon's stubs and the Python client's copy (clients/python), each
    # with its imports under its own package.
    fresh = {
        p.relative_to(tmp_path): p.read_bytes()
        for p in gen_protos.generate(tmp_path, py_package)
        if p.name != "__init__.py"
    }
    committed = {
        p.relative_to(committed_root): p.read_bytes()
        for p in committed_root.rglob("*_pb2*.py*")
        if p.suffix in (".py", ".pyi")
    }
    assert fresh.keys() == committed.keys()
    stale = sorted(str(name) for name in fresh if fresh[name] != committed[name])
    assert not stale, f"stale stubs {stale}: run `make protos` and commit the result"


def _buf() -> str | None:
    local = ROOT / ".tools" / "node_modules" / ".bin" / "buf"
    return str(local) if local.exists() else shutil.which("buf")


def test_buf_lint_standard_rules() -> None:
    buf = require_tool(_buf(), "buf (`make buf` installs it with npm)")
    result = subprocess.run(
        [buf, "lint"], cwd=ROOT, capture_output=True, text=True, timeout=START_SECONDS, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "STANDARD" in (ROOT / "buf.yaml").read_text()


def test_the_wheel_carries_importable_stubs(tmp_path: Path) -> None:
    # Built with the setuptools the dev install already has (grpcio-tools
    # needs it): what goes into the wheel is pyproject.toml's package data,
    # the same either way, and an isolated build env costs seconds of CPU.
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--wheel-dir",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("memory_sidecar-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {
        "sidecar/_proto/memory/v1/memory_pb2.py",
        "sidecar/_proto/memory/v1/memory_pb2.pyi",
        "sidecar/_proto/memory/v1/memory_pb2_grpc.py",
        "sidecar/py.typed",
    } <= names
    # Import the stubs from the wheel itself, not from the source tree.
    probe = (
        "import sidecar, sidecar._proto.memory.v1.memory_pb2_grpc as g;"
        f"assert sidecar.__file__.startswith({str(wheel)!r}), sidecar.__file__;"
        "print(g.MemoryServiceStub.__name__)"
    )
    env = {**os.environ, "PYTHONPATH": str(wheel)}
    result = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=START_SECONDS,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "MemoryServiceStub"
