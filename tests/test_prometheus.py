"""End to end: a real Prometheus scrapes the daemon; PromQL reads the hit ratio."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from sidecar._proto.memory.v1 import memory_pb2 as pb
from tests.conftest import (
    CALL_SECONDS,
    START_SECONDS,
    MakeSidecar,
    eventually,
    require_tool,
)

HIT_RATIO = 'sum(memory_snapshot_lookups_total{result="hit"}) / sum(memory_snapshot_lookups_total)'


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def query(base: str, promql: str) -> list[dict[str, object]]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=CALL_SECONDS) as response:
        body = json.load(response)
    assert body["status"] == "success", body
    result: list[dict[str, object]] = body["data"]["result"]
    return result


@pytest.fixture
def prometheus_binary() -> str:
    return require_tool(
        shutil.which("prometheus"), "Prometheus (Debian's prometheus package; .ci/run installs it)"
    )


@pytest.fixture
def prometheus(prometheus_binary: str, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A Prometheus on a free port; the test writes the scrape target file."""
    targets = tmp_path / "targets.json"
    targets.write_text("[]")
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: memory-sidecar\n"
        "    scrape_interval: 1s\n"
        f"    file_sd_configs: [{{files: ['{targets}'], refresh_interval: 1s}}]\n"
    )
    port = free_port()
    log = (tmp_path / "prometheus.log").open("w")
    process = subprocess.Popen(
        [
            prometheus_binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"

    def its_log() -> str:
        return (tmp_path / "prometheus.log").read_text()

    def ready() -> bool:
        try:
            with urllib.request.urlopen(f"{base}/-/ready", timeout=1):
                return True
        except OSError:
            pass
        assert process.poll() is None, "Prometheus exited:\n" + its_log()
        return False

    try:
        eventually(
            ready, lambda: "Prometheus is ready:\n" + its_log(), within=START_SECONDS, pause=0.2
        )
        yield base, targets
    finally:
        process.terminate()
        process.wait(START_SECONDS)
        log.close()


def test_prometheus_reads_the_hit_ratio(
    make_sidecar: MakeSidecar, prometheus: tuple[str, Path]
) -> None:
    base, targets = prometheus
    running = make_sidecar(metrics_listen="127.0.0.1:0")
    targets.write_text(json.dumps([{"targets": [running.addresses.metrics]}]))
    scope = pb.Scope(agent_id="coder", user_id="ada")
    running.add("The repo uses uv", scope=scope)
    # 3 sessions: 3 misses, then 9 cached turns: 9 hits -> 75%.
    for session in ("a", "b", "c"):
        for _ in range(4):
            running.turn(session, "uv", scope=scope)

    def scraped() -> list[dict[str, object]] | None:
        """The hit ratio, once Prometheus has scraped all 12 lookups."""
        result = query(base, HIT_RATIO)
        lookups = query(base, "sum(memory_snapshot_lookups_total)")
        if result and lookups and float(lookups[0]["value"][1]) == 12:  # type: ignore[index]
            return result
        return None

    ratio = eventually(
        scraped, "Prometheus scrapes all 12 lookups", within=START_SECONDS, pause=0.5
    )
    assert float(ratio[0]["value"][1]) == pytest.approx(0.75)  # type: ignore[index]
    up = query(base, 'up{job="memory-sidecar"}')
    assert [float(r["value"][1]) for r in up] == [1.0]  # type: ignore[index]
