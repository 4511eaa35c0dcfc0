"""Deployment material: manifests, image, alerts and dashboard, checked offline."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from sidecar import cli, config
from tests.conftest import ROOT, MakeSidecar, require_tool

DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
REPLICAS = DEPLOY / "k8s-replicas"
# Kinds the Kubernetes schemas know; the rest are custom resources.
CORE_KINDS = {
    K8S: {"Pod", "ConfigMap", "PersistentVolumeClaim"},
    REPLICAS: {"Deployment", "ConfigMap", "Secret", "PodDisruptionBudget"},
}
# Applied on their own, after an operator is installed.
NOT_IN_KUSTOMIZATION = {"cnpg-cluster.yaml"}


def documents(directory: Path = K8S) -> list[tuple[Path, dict[str, Any]]]:
    docs = []
    for path in sorted(directory.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            docs.append((path, doc))
    return docs


def by_kind(kind: str, directory: Path = K8S) -> dict[str, Any]:
    (doc,) = [d for _, d in documents(directory) if d["kind"] == kind]
    return doc


@pytest.mark.parametrize("directory", [K8S, REPLICAS], ids=["pod", "replicas"])
@pytest.mark.parametrize("version", ["1.29.0", kubernetes_validate.latest_version()])
def test_core_manifests_match_the_kubernetes_schemas(directory: Path, version: str) -> None:
    checked = set()
    for path, doc in documents(directory):
        if doc["kind"] in CORE_KINDS[directory]:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{path.name}: {exc.message} at {list(exc.path)}")
            checked.add(doc["kind"])
    assert checked == CORE_KINDS[directory]


@pytest.mark.parametrize("directory", [K8S, REPLICAS], ids=["pod", "replicas"])
def test_kustomization_lists_every_manifest(directory: Path) -> None:
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    assert listed == {p.name for p, _ in documents(directory)} - NOT_IN_KUSTOMIZATION


def outlasts_the_startup_timeout(probe: dict[str, Any], cfg: config.Config) -> None:
    """The kubelet gives up on a start later than the sidecar does (its
    last attempt may take a connect timeout more), so the sidecar's exit,
    with its reason, is what the operator finds; and it does give up."""
    window = probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)
    timeout = cfg.server.startup_timeout_seconds
    assert timeout > 0
    assert window >= timeout + cfg.server.busy_timeout_ms / 1000 + 10


def test_pod_runs_the_sidecar_natively_with_grpc_probes() -> None:
    pod = by_kind("Pod")
    spec = pod["spec"]
    (sidecar,) = spec["initContainers"]
    assert sidecar["restartPolicy"] == "Always"
    cfg = _config()
    health_port = int(cfg.server.health_listen.rpartition(":")[2])
    assert cfg.server.health_listen.startswith("0.0.0.0:")
    assert cfg.server.listen.startswith("127.0.0.1:")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert sidecar[probe]["grpc"]["port"] == health_port
    outlasts_the_startup_timeout(sidecar["startupProbe"], cfg)
    ports = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
    metrics_port = int(cfg.server.metrics_listen.rpartition(":")[2])
    assert ports["metrics"] == metrics_port
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == metrics_port
    assert spec["terminationGracePeriodSeconds"] > cfg.server.grace_seconds + 5
    # The database lives on the data volume.
    mounts = {m["name"]: m["mountPath"] for m in sidecar["volumeMounts"]}
    assert cfg.server.db.startswith(mounts["data"] + "/")
    volumes = {v["name"]: v for v in spec["volumes"]}
    claim = volumes["data"]["persistentVolumeClaim"]["claimName"]
    assert by_kind("PersistentVolumeClaim")["metadata"]["name"] == claim
    assert volumes["config"]["configMap"]["name"] == by_kind("ConfigMap")["metadata"]["name"]


# Both examples' pod specs: the single pod and the Deployment's template.
POD_SPECS = pytest.mark.parametrize(
    "spec",
    [by_kind("Pod")["spec"], by_kind("Deployment", REPLICAS)["spec"]["template"]["spec"]],
    ids=["pod", "replicas"],
)


def _mebibytes(quantity: str) -> float:
    units = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024}
    return float(quantity[:-2]) * units[quantity[-2:]]


@POD_SPECS
def test_the_memory_limit_holds_the_tier_size_the_docs_promise(spec: dict[str, Any]) -> None:
    figures = json.loads((ROOT / "docs" / "benchmarks.json").read_text())
    assert figures["mode"] == "full", "commit a full `make bench` run"
    (sidecar,) = spec["initContainers"]
    limit = _mebibytes(sidecar["resources"]["limits"]["memory"])
    promised = "100000"  # deploy/README.md: "The 256Mi limit holds one tier of 100,000"
    assert "holds one tier of 100,000" in (DEPLOY / "README.md").read_text()
    needed = figures["idle_rss_mib"] + figures["tier_rss_growth_mib"][promised]
    assert limit >= needed, f"{limit} MiB limit, {needed} MiB measured"


@POD_SPECS
def test_every_container_is_locked_down_and_sized(spec: dict[str, Any]) -> None:
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    for container in spec["initContainers"] + spec["containers"]:
        security = container["securityContext"]
        assert security["allowPrivilegeEscalation"] is False
        assert security["readOnlyRootFilesystem"] is True
        assert security["capabilities"]["drop"] == ["ALL"]
        assert set(container["resources"]) == {"requests", "limits"}


def test_podmonitor_scrapes_the_metrics_port_of_the_pod() -> None:
    monitor = by_kind("PodMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    pod = by_kind("Pod")
    labels = pod["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    (sidecar,) = pod["spec"]["initContainers"]
    assert endpoint["port"] in {p["name"] for p in sidecar["ports"]}
    assert endpoint["path"] == "/metrics"


def _config(
    directory: Path = K8S, environ: dict[str, str] | None = None, files: Path | None = None
) -> config.Config:
    """The ConfigMap's config.yaml as the sidecar loads it; `files` stands
    in for the root of the container's filesystem (mounted Secrets)."""
    text = by_kind("ConfigMap", directory)["data"]["config.yaml"]
    if files is not None:
        text = re.sub(r"(_file: )/", rf"\1{files}/", text)
    path = ROOT / ".pytest_cache" / f"deploy-config-{directory.name}.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)
    return config.load(path, environ=environ or {})


def test_the_configmap_is_a_valid_sidecar_config() -> None:
    cfg = _config()
    assert cfg.server.db == "/data/memory.db"


def test_replicas_share_one_postgresql_through_a_dsn_secret(tmp_path: Path) -> None:
    deployment = by_kind("Deployment", REPLICAS)
    assert deployment["spec"]["replicas"] >= 2
    pod = deployment["spec"]["template"]
    labels = pod["metadata"]["labels"].items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels
    spec = pod["spec"]
    (sidecar,) = spec["initContainers"]
    assert sidecar["restartPolicy"] == "Always"

    # The DSN comes from the Secret, through the environment.
    (env,) = sidecar["env"]
    ref = env["valueFrom"]["secretKeyRef"]
    secret = by_kind("Secret", REPLICAS)
    assert ref["name"] == secret["metadata"]["name"]
    dsn = secret["stringData"][ref["key"]]
    parts = urllib.parse.urlsplit(dsn)
    assert parts.password is None, "the password belongs in db_password_file"
    query = dict(urllib.parse.parse_qsl(parts.query))
    assert query["sslmode"] == "verify-full"

    # Every file the sidecar reads is mounted, from the Secret that holds it.
    mounts = {m["mountPath"]: m["name"] for m in sidecar["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}

    def source(path: str) -> tuple[str, str]:
        directory, _, name = path.rpartition("/")
        secret = volumes[mounts[directory]]["secret"]
        (item,) = [i for i in secret["items"] if i["path"] == name]
        return secret["secretName"], item["key"]

    password_file = "/etc/memory-db/password"
    (tmp_path / password_file[1:]).parent.mkdir(parents=True)
    (tmp_path / password_file[1:]).write_text("s3cret\n")
    cfg = _config(REPLICAS, environ={env["name"]: dsn}, files=tmp_path)
    assert cfg.server.db == dsn
    assert cfg.server.db_password == "s3cret"
    assert cfg.server.db_password_file == f"{tmp_path}{password_file}"
    assert cfg.server.listen.startswith("127.0.0.1:")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert sidecar[probe]["grpc"]["port"] == int(cfg.server.health_listen.rpartition(":")[2])
    outlasts_the_startup_timeout(sidecar["startupProbe"], cfg)
    assert spec["terminationGracePeriodSeconds"] > cfg.server.grace_seconds + 5
    assert "persistentVolumeClaim" not in str(volumes), "no SQLite file in this example"

    # The names CloudNativePG derives from the cluster's: the -rw service, the
    # -app and -ca secrets, the bootstrap database and its owner.
    cluster = yaml.safe_load((REPLICAS / "cnpg-cluster.yaml").read_text())
    name = cluster["metadata"]["name"]
    assert parts.hostname == f"{name}-rw"
    initdb = cluster["spec"]["bootstrap"]["initdb"]
    assert (parts.username, parts.path) == (initdb["owner"], "/" + initdb["database"])
    assert source(password_file) == (f"{name}-app", "password")
    assert source(query["sslrootcert"]) == (f"{name}-ca", "ca.crt")
    # Room for every replica's pool and listener, with one more pod rolling in.
    per_replica = cfg.server.max_workers + 4 + 1
    surge = deployment["spec"]["strategy"]["rollingUpdate"]["maxSurge"]
    wanted = (deployment["spec"]["replicas"] + surge) * per_replica
    assert int(cluster["spec"]["postgresql"]["parameters"]["max_connections"]) >= wanted + 10

    pdb = by_kind("PodDisruptionBudget", REPLICAS)
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels
    monitor = by_kind("PodMonitor", REPLICAS)
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels


def test_dockerfile_is_non_root_with_a_volume_and_a_health_check() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    user = re.findall(r"^USER (\S+)", text, flags=re.MULTILINE)
    assert user
    assert user[-1].split(":")[0] not in ("0", "root")
    assert 'VOLUME ["/data"]' in text
    assert re.search(r'HEALTHCHECK .*\n\s+CMD \["memory-sidecar", "health"', text)
    assert "FROM python:3.11-slim" in text
    environ = dict(re.findall(r"(MEMORY_SIDECAR_[A-Z_]+)=(\S+)", text))
    cfg = config.load(environ=environ)
    assert cfg.server.db == "/data/memory.db"
    assert cfg.server.listen == "127.0.0.1:50051"


def test_health_command(make_sidecar: MakeSidecar, capsys: pytest.CaptureFixture[str]) -> None:
    running = make_sidecar(health_listen="127.0.0.1:0")
    assert running.addresses.health is not None
    code = cli.main(["health", "--address", running.addresses.health], environ={})
    assert (code, capsys.readouterr().out) == (0, "SERVING\n")
    running.sidecar.health.enter_graceful_shutdown()
    code = cli.main(["health", "--address", running.addresses.health], environ={})
    assert (code, capsys.readouterr().out) == (1, "NOT_SERVING\n")
    code = cli.main(["health", "--address", "127.0.0.1:1", "--timeout", "1"], environ={})
    assert code == 1
    assert "health check of 127.0.0.1:1 failed" in capsys.readouterr().err


def test_alert_rules_pass_promtool() -> None:
    promtool = require_tool(shutil.which("promtool"), "promtool (Debian's prometheus package)")
    rules = DEPLOY / "prometheus"
    for command in (["check", "rules", "alerts.yaml"], ["test", "rules", "alerts.test.yaml"]):
        result = subprocess.run(
            [promtool, *command],
            cwd=rules,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert result.returncode == 0, result.stdout + result.stderr


def test_dashboard_and_alerts_use_only_exported_metrics(make_sidecar: MakeSidecar) -> None:
    running = make_sidecar(metrics_listen="127.0.0.1:0")
    with urllib.request.urlopen(f"http://{running.addresses.metrics}/metrics", timeout=5) as r:
        exported = set(re.findall(r"^# TYPE (\w+) (\w+)", r.read().decode(), flags=re.M))
    names = set()
    for name, kind in exported:
        names.add(name)
        if kind == "counter":
            names.add(name + "_total")
        if kind == "histogram":
            names.update(name + suffix for suffix in ("_bucket", "_count", "_sum"))

    dashboard = json.loads((DEPLOY / "grafana" / "memory-sidecar.json").read_text())
    assert dashboard["uid"] == "memory-sidecar"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    expressions = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yaml").read_text())
    expressions += [r["expr"] for g in rules["groups"] for r in g["rules"]]
    used = {
        m
        for e in expressions
        for m in re.findall(r"\b([a-z_]+(?:_total|_bucket|_bytes|_active))\b", e)
    }
    assert used
    assert used <= names, used - names
    # And the dashboard shows every metric of the sidecar's own.
    panels = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    ours = {n for n, _ in exported if n.startswith("memory_") and not n.endswith("_created")}
    assert "memory_change_feed_verified" in ours
    assert {name for name in ours if name not in panels} == set()
