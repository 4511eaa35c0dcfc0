"""Who may call: bearer tokens, TLS, Unix socket permissions, loopback."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar._proto.memory.v1 import memory_pb2_grpc as pb_grpc
from sidecar.api.interceptors import TokenFile
from sidecar.ops import cli
from tests.conftest import (
    CALL_SECONDS,
    START_SECONDS,
    MakeSidecar,
    error_info,
    refused,
    require_tool,
    run_sidecar,
    spawn_daemon,
)

TOKEN = "s3cr3t-token-value"


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return path


def with_token(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def test_every_api_call_needs_the_token(make_sidecar: MakeSidecar, token_file: Path) -> None:
    running = make_sidecar(auth_token_file=str(token_file), health_listen="127.0.0.1:0")
    stub = running.stub
    missing = refused(stub.GetMemories, pb.GetMemoriesRequest(), timeout=CALL_SECONDS)
    assert missing.code() == grpc.StatusCode.UNAUTHENTICATED
    assert error_info(missing).reason == "TOKEN_MISSING"
    wrong = refused(
        stub.AddMemory,
        pb.AddMemoryRequest(content="x"),
        timeout=CALL_SECONDS,
        metadata=with_token("not-it"),
    )
    assert wrong.code() == grpc.StatusCode.UNAUTHENTICATED
    assert error_info(wrong).reason == "TOKEN_INVALID"
    prefix = refused(
        stub.AddMemory,
        pb.AddMemoryRequest(content="x"),
        timeout=CALL_SECONDS,
        metadata=with_token(TOKEN[:-1]),
    )
    assert prefix.code() == grpc.StatusCode.UNAUTHENTICATED
    assert (
        list(stub.GetMemories(pb.GetMemoriesRequest(), metadata=with_token(TOKEN)).memories) == []
    )
    added = stub.AddMemory(pb.AddMemoryRequest(content="with token"), metadata=with_token(TOKEN))
    assert added.created
    # Nothing was written by the refused calls.
    listed = stub.GetMemories(pb.GetMemoriesRequest(), metadata=with_token(TOKEN))
    assert [m.content for m in listed.memories] == ["with token"]

    # Reflection is part of the API: it needs the token too.
    reflect = reflection_pb2_grpc.ServerReflectionStub(running.channel)
    with pytest.raises(grpc.RpcError) as raised:
        list(
            reflect.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                timeout=CALL_SECONDS,
            )
        )
    assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED

    # Health answers without a token, on both listeners.
    for address in (running.addresses.api, running.addresses.health):
        assert address is not None
        with grpc.insecure_channel(address) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=CALL_SECONDS
            )
            assert status.status == health_pb2.HealthCheckResponse.SERVING


def test_a_rotated_token_takes_effect_without_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("first")
    tokens = TokenFile(str(path))
    assert tokens.token() == b"first"
    # Kubernetes swaps Secret files atomically: a new file behind the name.
    replacement = tmp_path / "token.new"
    replacement.write_text("second\n")
    os.replace(replacement, path)
    assert tokens.token() == b"first"  # read only by reload (the watcher's)
    tokens.reload()
    assert tokens.token() == b"second"
    path.unlink()
    tokens.reload()
    assert tokens.token() == b"second"  # keeps the last good token mid-swap


def test_a_token_rewritten_in_place_is_noticed_and_an_empty_one_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "token"
    path.write_text("first-token")
    before = os.stat(path)
    tokens = TokenFile(str(path))
    # Caught mid-rewrite: the file is empty for a moment.
    path.write_text("")
    tokens.reload()
    assert tokens.token() == b"first-token"
    assert "empty; keeping the last good token" in caplog.text
    # Rewritten in place, same length, same inode, and the same mtime (a
    # coarse filesystem clock): only the bytes tell.
    with open(path, "r+") as handle:
        handle.write("other-token")
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_ino, after.st_mtime_ns, after.st_size) == (
        before.st_ino,
        before.st_mtime_ns,
        before.st_size,
    )
    tokens.reload()
    assert tokens.token() == b"other-token"


def test_an_emptied_token_file_never_fails_calls(
    make_sidecar: MakeSidecar, token_file: Path
) -> None:
    running = make_sidecar(auth_token_file=str(token_file))
    good = with_token(TOKEN)
    token_file.write_text("")
    for _ in range(3):  # across the once-a-second re-read
        response = running.stub.GetMemories(
            pb.GetMemoriesRequest(scope=pb.Scope(agent_id="a")), metadata=good, timeout=CALL_SECONDS
        )
        assert len(response.usage) == 2
        with pytest.raises(grpc.RpcError) as caught:
            running.stub.GetMemories(
                pb.GetMemoriesRequest(), metadata=with_token("wrong"), timeout=CALL_SECONDS
            )
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        time.sleep(0.6)


def test_the_cli_sends_the_configured_token(
    make_sidecar: MakeSidecar,
    token_file: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    running = make_sidecar(auth_token_file=str(token_file))
    config = tmp_path / "cli.yaml"
    config.write_text(f"server: {{auth_token_file: '{token_file}'}}\n")
    code = cli.main(
        ["add", "from the cli", "--address", running.addresses.api, "--config", str(config)],
        environ={},
    )
    assert code == 0, capsys.readouterr().err
    code = cli.main(["list", "--address", running.addresses.api], environ={})
    assert code == 1
    assert "UNAUTHENTICATED (TOKEN_MISSING)" in capsys.readouterr().err


def test_non_loopback_without_a_token_is_refused(tmp_path: Path) -> None:
    result = run_sidecar("serve", "--db", str(tmp_path / "m.db"), "--listen", "0.0.0.0:0")
    assert result.returncode == 2
    assert "server.listen: 0.0.0.0:0 is reachable from other hosts" in result.stderr
    assert "--insecure" in result.stderr
    daemon = spawn_daemon("--db", str(tmp_path / "m.db"), "--listen", "0.0.0.0:0", "--insecure")
    daemon.close()
    token = tmp_path / "token"
    token.write_text("t")
    daemon = spawn_daemon(
        "--db", str(tmp_path / "m.db"), "--listen", "0.0.0.0:0", "--auth-token-file", str(token)
    )
    daemon.close()


def test_a_missing_token_file_stops_the_daemon(tmp_path: Path) -> None:
    result = run_sidecar(
        "serve",
        "--db",
        str(tmp_path / "m.db"),
        "--listen",
        "127.0.0.1:0",
        "--auth-token-file",
        str(tmp_path / "absent"),
    )
    assert result.returncode == 1
    assert "server.auth_token_file: cannot read" in result.stderr


def test_unix_socket_is_owner_only(tmp_path: Path) -> None:
    sock = tmp_path / "api.sock"
    daemon = spawn_daemon("--db", str(tmp_path / "m.db"), "--listen", f"unix:{sock}")
    try:
        mode = stat.S_IMODE(os.stat(sock).st_mode)
        assert mode == 0o600, oct(mode)
    finally:
        daemon.close()


# --- TLS ------------------------------------------------------------------------


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(
        ["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=START_SECONDS
    )


@pytest.fixture
def pki(tmp_path: Path) -> Path:
    """A throwaway CA, a server certificate for 127.0.0.1, a client certificate."""
    require_tool(shutil.which("openssl"), "openssl")
    d = tmp_path / "pki"
    d.mkdir()
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=test-ca",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        cwd=d,
    )
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name, cn in (("server", "localhost"), ("client", "agent")):
        _openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            f"/CN={cn}",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            cwd=d,
        )
        _openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            "san.ext",
            "-out",
            f"{name}.pem",
            cwd=d,
        )
    return d


def test_tls_on_the_api(make_sidecar: MakeSidecar, pki: Path) -> None:
    running = make_sidecar(
        tls_cert_file=str(pki / "server.pem"), tls_key_file=str(pki / "server.key")
    )
    credentials = grpc.ssl_channel_credentials((pki / "ca.pem").read_bytes())
    with grpc.secure_channel(running.addresses.api, credentials) as channel:
        added = pb_grpc.MemoryServiceStub(channel).AddMemory(
            pb.AddMemoryRequest(content="over TLS"), timeout=CALL_SECONDS
        )
        assert added.created
    # Plaintext gets nowhere.
    with grpc.insecure_channel(running.addresses.api) as channel:
        error = refused(
            pb_grpc.MemoryServiceStub(channel).GetMemories,
            pb.GetMemoriesRequest(),
            timeout=CALL_SECONDS,
        )
        assert error.code() == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_requires_a_client_certificate(make_sidecar: MakeSidecar, pki: Path) -> None:
    running = make_sidecar(
        tls_cert_file=str(pki / "server.pem"),
        tls_key_file=str(pki / "server.key"),
        tls_client_ca_file=str(pki / "ca.pem"),
    )
    ca = (pki / "ca.pem").read_bytes()
    anonymous = grpc.ssl_channel_credentials(ca)
    with grpc.secure_channel(running.addresses.api, anonymous) as channel:
        error = refused(
            pb_grpc.MemoryServiceStub(channel).GetMemories,
            pb.GetMemoriesRequest(),
            timeout=CALL_SECONDS,
        )
        assert error.code() == grpc.StatusCode.UNAVAILABLE
    identified = grpc.ssl_channel_credentials(
        ca, (pki / "client.key").read_bytes(), (pki / "client.pem").read_bytes()
    )
    with grpc.secure_channel(running.addresses.api, identified) as channel:
        listed = pb_grpc.MemoryServiceStub(channel).GetMemories(
            pb.GetMemoriesRequest(), timeout=CALL_SECONDS
        )
        assert list(listed.memories) == []
