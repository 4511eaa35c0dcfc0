"""bench.client_overhead and bench.client_probes: a missing toolchain leaves
its rows "not run (why)" instead of failing the section."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from bench import client_probes
from bench.client_overhead import _ratio, _rows


def test_without_go_or_node_the_probes_say_why_and_run_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Neither toolchain on this machine, as far as the probes can tell.
    monkeypatch.setattr(shutil, "which", lambda name: None)
    go, typescript = client_probes.build_go(tmp_path), client_probes.build_typescript(tmp_path)
    assert (go.skipped, typescript.skipped) == ("go not found", "node not found")
    asked = ("127.0.0.1:1", "agent", "user", "message", 10)
    probe = client_probes.run_go(go, *asked)
    assert probe.skipped == "go not found"
    assert client_probes.run_typescript(typescript, *asked).skipped == "node not found"
    assert list(tmp_path.iterdir()) == []  # nothing built
    assert _ratio(probe) is None
    assert _rows("Go", "raw stub: InjectForTurn", "Go Client.Turn", probe) == [
        ["Go raw stub: InjectForTurn", "not run (go not found)", "-", "-"],
        ["Go Client.Turn", "not run (go not found)", "-", "-"],
    ]


def test_a_measured_probe_is_a_row_pair_against_its_own_stub() -> None:
    probe = client_probes.Probe(stub=(0.001, 0.002), client=(0.0011, 0.003), cached=True)
    assert _ratio(probe) == 1.1
    assert _rows("TypeScript", "raw stub: injectForTurn", "MemoryClient.turn", probe) == [
        ["TypeScript raw stub: injectForTurn", "1,000 µs", "2,000 µs", "1.00x"],
        ["MemoryClient.turn", "1,100 µs", "3,000 µs", "1.10x"],
    ]
