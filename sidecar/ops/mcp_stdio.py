"""`memory-sidecar mcp`: MCP over stdio, bridged to a running daemon.

For MCP clients that spawn their servers as processes (Claude Desktop,
Cursor, ...). The process serves sidecar.api.mcp_server on its stdin and stdout
and answers every request with the daemon's gRPC API: ListTools and
CallTool for the tools, InjectForTurn for the frozen block and the turn
block. It opens no database: the daemon stays the one owner of the store's
caches, sessions and snapshots, so a write through this bridge refreshes
frozen blocks exactly as any gRPC write does, and the token's grant
(per-agent tokens) applies unchanged.

A token or CA file it cannot read is said in one line on stderr (a host's
log shows it) and the bridge still serves MCP, answering every request
with that reason (TOKEN_FILE_UNREADABLE, ...), so the host shows it too.

The scope is the command line's (`--agent-id`, `--user-id`), never the
model's. The runtime session is `--session-id`, or one of the process's own
that it ends (EndSession) when the client closes it. The daemon's address,
token and TLS come as for the other online commands (`--address`,
`--token-file`, `--tls-ca-file`, or the configuration).

Owns: the bridge: the gRPC Backend, gRPC errors turned back into
SidecarErrors (so both transports answer alike), the process's session.
Must not touch: the engine or the store, os.environ. It takes the online
commands' channel (token, TLS) from sidecar.ops.channel.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import anyio
import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from mcp.server.stdio import stdio_server

from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar._proto.memory.v1 import memory_pb2_grpc as pb_grpc
from sidecar.api import mcp_server
from sidecar.config.settings import Config
from sidecar.core.errors import (
    AlreadyExists,
    CallerGone,
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Reason,
    ResourceExhausted,
    SidecarError,
    Unauthenticated,
    Unavailable,
    Unimplemented,
)
from sidecar.domain.tool_definitions import ToolDef, ToolResult
from sidecar.ops.channel import online_channel

log = logging.getLogger("sidecar.mcp_stdio")

# A status from the daemon back into the leaf it was raised as.
_LEAVES: dict[str, type[SidecarError]] = {
    leaf.code: leaf
    for leaf in (
        InvalidArgument,
        NotFound,
        AlreadyExists,
        FailedPrecondition,
        ResourceExhausted,
        DataLoss,
        Unimplemented,
        Unavailable,
        Unauthenticated,
        PermissionDenied,
        CallerGone,
    )
}


def remote_error(exc: grpc.RpcError, address: str, timeout: float) -> SidecarError:
    """The SidecarError a failed call stands for, reason and metadata kept."""
    code = exc.code()
    status = rpc_status.from_call(exc)
    info = error_details_pb2.ErrorInfo()
    answered = status is not None and any(detail.Unpack(info) for detail in status.details)
    if not answered:
        # gRPC's own failure: nothing listening, or not ready within timeout.
        return Unavailable(
            f"cannot reach memory-sidecar at {address} within {timeout:g} s "
            f"({code.name}: {exc.details()}); is the daemon running?",
            reason=Reason.DAEMON_UNREACHABLE,
            metadata={"address": address},
        )
    leaf = _LEAVES.get(code.name, SidecarError)
    return leaf(exc.details() or code.name, reason=info.reason, metadata=dict(info.metadata))


class Bridge:
    """sidecar.api.mcp_server.Backend over a daemon's gRPC API, in one scope and session."""

    def __init__(
        self,
        channel: grpc.Channel,
        scope: pb.Scope,
        session_id: str,
        *,
        address: str,
        timeout: float,
    ) -> None:
        self._stub = pb_grpc.MemoryServiceStub(channel)
        self._scope = scope
        self.session_id = session_id
        self._address = address
        self._timeout = timeout

    def _call(self, method: str, request: Any, *, wait: bool = True) -> Any:
        try:
            # A daemon still starting is waited for, up to the timeout.
            return getattr(self._stub, method)(request, timeout=self._timeout, wait_for_ready=wait)
        except grpc.RpcError as exc:
            raise remote_error(exc, self._address, self._timeout) from None

    def definitions(self) -> list[ToolDef]:
        listed = self._call("ListTools", pb.ListToolsRequest(scope=self._scope))
        return [
            ToolDef(tool.name, tool.description, json.loads(tool.input_schema_json))
            for tool in listed.tools
        ]

    def call(self, name: str, arguments: Mapping[str, Any]) -> ToolResult:
        answer = self._call(
            "CallTool",
            pb.CallToolRequest(
                scope=self._scope,
                session_id=self.session_id,
                name=name,
                arguments_json=json.dumps(dict(arguments)),
            ),
        )
        structured = json.loads(answer.structured_json) if answer.structured_json else {}
        return ToolResult(answer.text, structured, answer.is_error)

    def _turn(self, user_message: str) -> Any:
        request = pb.InjectForTurnRequest(
            scope=self._scope, session_id=self.session_id, user_message=user_message
        )
        return self._call("InjectForTurn", request)

    def frozen_block(self) -> str:
        return str(self._turn("").system_block)

    def turn_context(self, user_message: str) -> str:
        return str(self._turn(user_message).turn_context)

    def end(self) -> None:
        """End the session (its snapshot is let go). A failure is only logged:
        the daemon evicts a session left idle anyway."""
        try:
            # Not waited for: a daemon gone by now has no session to end.
            request = pb.EndSessionRequest(scope=self._scope, session_id=self.session_id)
            self._call("EndSession", request, wait=False)
        except SidecarError as exc:
            log.info("could not end the MCP session %s: %s", self.session_id, exc.message)


@dataclass(frozen=True, slots=True)
class Refusing:
    """sidecar.api.mcp_server.Backend that answers every request with why the
    bridge cannot reach the daemon (its token or CA file unreadable): the
    host still gets its MCP session, and reads the reason in each error."""

    error: SidecarError

    def definitions(self) -> list[ToolDef]:
        raise self.error

    def call(self, name: str, arguments: Mapping[str, Any]) -> ToolResult:
        raise self.error

    def frozen_block(self) -> str:
        raise self.error

    def turn_context(self, user_message: str) -> str:
        raise self.error


async def _serve(backend: mcp_server.Backend) -> None:
    server = mcp_server.build(lambda ctx: backend)
    async with stdio_server() as (read, write):
        await server.run(read, write, server.create_initialization_options())


def _refuse(error: SidecarError) -> int:
    """One line on stderr (the host's log), then MCP on stdio, refusing."""
    print(f"memory-sidecar: {error.reason}: {error.message}", file=sys.stderr, flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        anyio.run(_serve, Refusing(error))
    return 1


def run(args: argparse.Namespace, config: Config) -> int:
    """Serve MCP on stdin and stdout until the client closes them."""
    address = args.address or config.server.listen
    try:
        channel = online_channel(address, args, config)
    except SidecarError as exc:
        return _refuse(exc)
    own = not args.session_id
    bridge = Bridge(
        channel,
        pb.Scope(agent_id=args.agent_id, user_id=args.user_id),
        args.session_id or f"mcp-stdio-{os.getpid()}-{uuid.uuid4().hex[:8]}",
        address=address,
        timeout=args.timeout,
    )
    try:
        anyio.run(_serve, bridge)
    except KeyboardInterrupt:
        pass
    finally:
        if own:
            bridge.end()
        channel.close()
    return 0
