"""What the docs show works as shown."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from sidecar.config import settings
from tests.conftest import ROOT, Running


def test_readme_client_example_runs(sidecar: Running) -> None:
    readme = (ROOT / "README.md").read_text()
    (example,) = re.findall(r"```python\n(.*?)```", readme, flags=re.DOTALL)
    assert 'ADDRESS = "127.0.0.1:50051"' in example
    code = example.replace("127.0.0.1:50051", sidecar.addresses.api)
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("TIER_MEMORY ")
    assert lines[0].endswith(" The repo uses uv, not pip")
    assert lines[1].endswith(" Ada prefers short answers")
    assert lines[2:4] == ["TIER_MEMORY 25/2200 chars", "TIER_USER 25/1375 chars"]
    assert lines[5] == "MEMORY (agent notes) [1% — 25/2,200 chars]"
    assert "Ada prefers short answers" in lines
    # As the README says: the frozen block shows every memory, the
    # transient block repeats none.
    assert lines[-1] == "''"


def test_example_config_is_valid_and_states_the_defaults() -> None:
    example = settings.load(ROOT / "deploy" / "config.example.yaml", environ={})
    assert example == settings.Config()


def test_readme_names_the_two_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "make run" in readme
    assert "make test" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_make_run_installs_the_daemon_without_the_dev_tools(tmp_path: Path) -> None:
    # A dry run against a venv that does not exist yet: what a fresh machine
    # would do.
    planned = subprocess.run(
        ["make", "-n", "run", f"VENV={tmp_path}/venv"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    installs = [line for line in planned.splitlines() if "pip install" in line and " -e " in line]
    assert installs == [f"{tmp_path}/venv/bin/python -m pip install --quiet -e '.[postgres]'"]
    assert "memory-sidecar serve" in planned


def _planned(target: str, tmp_path: Path) -> str:
    """What `make -n TARGET` would run on a fresh machine (no venv, no buf)."""
    return subprocess.run(
        ["make", "-n", target, f"VENV={tmp_path}/venv", "BUF=" + str(tmp_path / "no-buf")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def test_make_test_does_not_install_the_lint_tools(tmp_path: Path) -> None:
    # buf (93 MB from npm) serves `make lint` only.
    planned = _planned("test", tmp_path)
    assert "@bufbuild/buf" not in planned
    assert "-m pytest" in planned
    assert "@bufbuild/buf" in _planned("lint", tmp_path)
