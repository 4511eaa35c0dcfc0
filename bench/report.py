"""The report `make bench` writes: docs/BENCHMARKS.md and docs/benchmarks.json.

Owns `machine()` (commit, date, CPU and versions: the header of every report)
and `write()`: the sections' tables as Markdown at --output, and the report's
figures as benchmarks.json beside it (what tests/test_deploy.py reads). It
runs and measures nothing, so it compares against nothing.

Must not import a section module or bench.run. A change to the format changes
what the committed docs and tests/test_deploy.py are read as.
"""

from __future__ import annotations

import json
import os
import platform
import sqlite3
import subprocess
from datetime import UTC, datetime
from pathlib import Path

import grpc

import sidecar
from bench.measure import Report

ROOT = Path(__file__).resolve().parent.parent


# --- the report --------------------------------------------------------------------------


def _git(*args: str) -> str:
    """What a git command prints in the checkout ("" if it fails)."""
    done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
    return done.stdout.strip()


def machine() -> list[str]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    commit = _git("rev-parse", "--short", "HEAD")
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return [
        f"- commit: `{commit or 'unknown'}`{' (with uncommitted changes)' if dirty else ''}",
        f"- date: {datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- machine: {os.cpu_count()} CPUs ({cpu}), {platform.system()} {platform.release()}",
        f"- Python {platform.python_version()}, grpcio {grpc.__version__}, "
        f"memory-sidecar {sidecar.__version__}, SQLite {sqlite3.sqlite_version}",
    ]


def write(report: Report, output: Path) -> None:
    lines = [
        "# Benchmarks",
        "",
        "Measured by `make bench` (`python -m bench.run`); every figure stands beside a "
        "baseline measured in the same run. The machines are shared and noisy: compare "
        "ratios, not absolute times.",
        "",
    ]
    lines += machine()
    lines.append(f"- mode: {'quick (smoke; small sizes, few samples)' if report.quick else 'full'}")
    for title, intro, headers, rows in report.sections:
        lines += [
            "",
            f"## {title}",
            "",
            intro,
            "",
            "| " + " | ".join(headers) + " |",
            "|" + "|".join(" --- " for _ in headers) + "|",
        ]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
    if report.notes:
        lines += ["", "## Notes", ""] + [f"- {note}" for note in report.notes]
    output.write_text("\n".join(lines) + "\n")
    if report.figures:
        figures = {"mode": "quick" if report.quick else "full", **report.figures}
        output.with_name("benchmarks.json").write_text(json.dumps(figures, indent=2) + "\n")
    print(f"\nwrote {output}")
