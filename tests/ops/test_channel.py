"""The online commands' channel: a token or CA file that cannot be read is
one line on stderr, with its reason, from every command that talks to a
daemon, and never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from sidecar.core.errors import FailedPrecondition, Unauthenticated
from sidecar.ops.channel import read_ca, read_token
from tests.conftest import run_sidecar

# Every command that opens a channel to a daemon, with its own arguments.
ONLINE = (
    ("add", "a note"),
    ("list",),
    ("search", "a query"),
    ("update", "some-id", "--content", "new"),
    ("rm", "some-id"),
    ("usage",),
    ("inject", "hello"),
    ("export", "-", "--agent-id", "coder"),
)


@pytest.mark.parametrize("command", ONLINE, ids=lambda c: c[0])
def test_a_missing_token_file_is_one_line_from_every_online_command(
    tmp_path: Path, command: tuple[str, ...]
) -> None:
    missing = tmp_path / "no-such.token"
    address = f"unix:{tmp_path / 'daemon.sock'}"
    result = run_sidecar(*command, "--address", address, "--token-file", str(missing))
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith("memory-sidecar: TOKEN_FILE_UNREADABLE: the bearer token (--token-file)")
    assert str(missing) in line
    assert "No such file or directory" in line


def test_the_configured_token_file_is_named_as_the_configuration_key(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(f"server:\n  auth_token_file: {tmp_path / 'gone.token'}\n")
    address = f"unix:{tmp_path / 'daemon.sock'}"
    result = run_sidecar("list", "--config", str(config), "--address", address)
    assert result.returncode == 1
    (line,) = result.stderr.splitlines()
    assert "TOKEN_FILE_UNREADABLE: the bearer token (server.auth_token_file)" in line


def test_an_unreadable_ca_file_is_one_line(tmp_path: Path) -> None:
    address = f"unix:{tmp_path / 'daemon.sock'}"
    result = run_sidecar("usage", "--address", address, "--tls-ca-file", str(tmp_path))
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith("memory-sidecar: TLS_CA_FILE_UNREADABLE: the TLS CA (--tls-ca-file)")
    assert "not a regular file" in line


def test_read_token_refuses_what_is_not_a_token(tmp_path: Path) -> None:
    empty = tmp_path / "empty.token"
    empty.write_text("\n")
    for path, why in ((empty, "is empty"), (tmp_path, "not a regular file")):
        with pytest.raises(Unauthenticated) as raised:
            read_token(str(path))
        assert why in raised.value.message
        assert raised.value.reason == "TOKEN_FILE_UNREADABLE"
    good = tmp_path / "good.token"
    good.write_text("s3cret\n")
    assert read_token(str(good)) == "s3cret"


def test_the_message_never_holds_the_tokens_text(tmp_path: Path) -> None:
    # A file with a token, but too large to be one: the message names the
    # file and its size limit, not its content.
    big = tmp_path / "big.token"
    big.write_text("s3cret-" * 20_000)
    with pytest.raises(Unauthenticated) as raised:
        read_token(str(big))
    assert "s3cret" not in raised.value.message
    with pytest.raises(FailedPrecondition):
        read_ca(str(tmp_path / "none.pem"))
