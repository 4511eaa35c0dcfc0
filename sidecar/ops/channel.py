"""The online commands' channel to a daemon: its address, token and TLS.

Every command that talks to a running daemon (add, list, search, update, rm,
usage, inject, export --address, and the stdio bridge `mcp`) opens its
channel here, with the bearer token of `--token-file` (or the configured
`server.auth_token_file`) and the CA of `--tls-ca-file` (or the configured
`server.tls_cert_file`). A file that cannot be read is a SidecarError with
its reason (TOKEN_FILE_UNREADABLE, TLS_CA_FILE_UNREADABLE), which the
command reports in one line: never a traceback.

Owns: reading the client's token and CA files, the channel, the bearer
token's interceptor on a plaintext channel.
Must not touch: RPCs and their output (sidecar.ops.admin), the daemon's own
token files (sidecar.api.interceptors), os.environ.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import grpc

from sidecar.api.access import TOKEN_FILE_BYTES
from sidecar.api.reloading import Unreadable, read_regular
from sidecar.config.settings import Config
from sidecar.core.errors import FailedPrecondition, Reason, Unauthenticated

# A CA bundle is a few certificates; a system bundle a few hundred KiB.
CA_FILE_BYTES = 4 * 1024 * 1024


def read_token(path: str, flag: str = "--token-file") -> str:
    """The bearer token in `path`; Unauthenticated (TOKEN_FILE_UNREADABLE)
    when it is missing, unreadable or empty. The message names the file and
    `flag`, never what the file holds."""
    try:
        raw = read_regular(Path(path), TOKEN_FILE_BYTES)
    except Unreadable as exc:
        problem = str(exc)
    else:
        token = raw.decode("utf-8", errors="replace").strip()
        if token:
            return token
        problem = f"{path} is empty"
    raise Unauthenticated(
        f"the bearer token ({flag}): {problem}",
        reason=Reason.TOKEN_FILE_UNREADABLE,
        metadata={"path": path},
    )


def read_ca(path: str, flag: str = "--tls-ca-file") -> bytes:
    """The CA certificates in `path`; FailedPrecondition (TLS_CA_FILE_UNREADABLE)
    when they cannot be read."""
    try:
        return read_regular(Path(path), CA_FILE_BYTES)
    except Unreadable as exc:
        raise FailedPrecondition(
            f"the TLS CA ({flag}): {exc}",
            reason=Reason.TLS_CA_FILE_UNREADABLE,
            metadata={"path": path},
        ) from None


def online_channel(address: str, args: argparse.Namespace, config: Config) -> grpc.Channel:
    """A channel with the token and TLS the daemon's configuration asks for."""
    token_file = args.token_file or config.server.auth_token_file
    ca_file = args.tls_ca_file or config.server.tls_cert_file
    token_flag = "--token-file" if args.token_file else "server.auth_token_file"
    ca_flag = "--tls-ca-file" if args.tls_ca_file else "server.tls_cert_file"
    token = read_token(token_file, token_flag) if token_file else ""
    ca = read_ca(ca_file, ca_flag) if ca_file else None
    if ca is None:
        channel = grpc.insecure_channel(address)
        return grpc.intercept_channel(channel, _BearerToken(token)) if token else channel
    credentials = grpc.ssl_channel_credentials(ca)
    if token:
        credentials = grpc.composite_channel_credentials(
            credentials, grpc.access_token_call_credentials(token)
        )
    return grpc.secure_channel(address, credentials)


class _BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds `authorization: Bearer` on a plaintext channel (the loopback or
    Unix-socket API); grpc attaches call credentials only over TLS."""

    def __init__(self, token: str) -> None:
        self._metadata = ("authorization", f"Bearer {token}")

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        metadata = [*(details.metadata or ()), self._metadata]
        return continuation(details._replace(metadata=metadata), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        # Server-streaming calls (ExportMemories) carry it too.
        return self.intercept_unary_unary(continuation, details, request)
