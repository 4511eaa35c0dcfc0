"""The MCP surface: the memory tools, the frozen block and the turn block.

One low-level `mcp.server.Server` (the official MCP SDK, the mcp extra)
serves what a connection may use, through a `Backend` bound to that
connection's scope and session: in the daemon, `sidecar.domain.tools.Tools` over
the shared engine (sidecar.api.mcp_http, streamable HTTP); in `memory-sidecar
mcp`, the daemon's gRPC API (sidecar.ops.mcp_stdio, stdio). Both answer alike.

- Tools: `sidecar.domain.tools`' definitions, as they are. A result the model can
  act on (a full tier, no or several entries holding old_text, an unknown
  argument) is a tool result with isError; an error that is not the
  model's to fix (a token's grant, the database unavailable, an unknown
  tool) is a JSON-RPC error whose data carries the code, the stable reason
  and the metadata gRPC's ErrorInfo would.
- Resource `memory://frozen-block`: the session's frozen block, what
  InjectForTurn's system_block is for the same session. A resource because
  it is context the host application reads and places (in the system
  prompt, once per session), not something the model calls, and it takes
  no argument: the connection names the scope and the session.
- Prompt `memory_context(user_message)`: the turn block for a message, as
  InjectForTurn's turn_context. A prompt because it takes the user's message
  as its argument and is asked for by the host each turn; a resource URI
  is no place for a message. With nothing to add it has no message at all,
  never one with empty text (which a model's API may refuse).

The scope never comes from the model: no tool's schema has a scope field,
and unknown arguments are refused (sidecar.domain.tools).

Owns: the MCP handlers, Backend, how a ToolResult and a SidecarError become
MCP answers, the resource's URI and the prompt's name. Must not touch: the
transports, authentication and grants (the backends and sidecar.api.mcp_http
decide who may address a scope), the engine (only through a Backend), grpc.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol, TypeVar

import anyio.to_thread
import mcp.types as types
from mcp.server import Server
from mcp.server.context import ServerRequestContext
from mcp.shared.exceptions import MCPError

from sidecar import __version__
from sidecar.core.errors import SidecarError
from sidecar.domain.tool_definitions import LIST, MEMORY, SCHEMAS, SEARCH, ToolDef, ToolResult

log = logging.getLogger("sidecar.mcp_server")

FROZEN_BLOCK_URI = "memory://frozen-block"
PROMPT = "memory_context"
PROMPT_ARGUMENT = "user_message"
# The prompt's description when it has no message (nothing relevant to add).
NOTHING_TO_ADD = "No memories to add for this message"
INSTRUCTIONS = (
    "Long-term memory for this agent and its user. The memory tool saves, corrects and "
    "removes entries (target memory: your notes; target user: the user's profile); "
    "memory_search and memory_list read them. The resource memory://frozen-block is the "
    "memory block for the system prompt; the prompt memory_context gives the entries "
    "relevant to a user message."
)
# Bounded labels for the calls counted: a client may send any name.
TOOL_NAMES = frozenset(SCHEMAS)
_ANNOTATIONS = {
    MEMORY: types.ToolAnnotations(read_only_hint=False, destructive_hint=True),
    SEARCH: types.ToolAnnotations(read_only_hint=True),
    LIST: types.ToolAnnotations(read_only_hint=True),
}
# JSON-RPC codes for errors that are not the model's to fix. The rest of the
# server-error band is the SDK's or the spec's (-32000 is the SDK's "closed").
_CODES = {
    "INVALID_ARGUMENT": types.INVALID_PARAMS,
    "NOT_FOUND": types.INVALID_PARAMS,
    "PERMISSION_DENIED": types.INVALID_REQUEST,
    "UNAUTHENTICATED": types.INVALID_REQUEST,
}

T = TypeVar("T")


class Backend(Protocol):
    """The memory of one connection: its scope and session are bound in."""

    def definitions(self) -> list[ToolDef]: ...

    def call(self, name: str, arguments: Mapping[str, Any]) -> ToolResult: ...

    def frozen_block(self) -> str: ...

    def turn_context(self, user_message: str) -> str: ...


Context = ServerRequestContext[Any, Any]
# The connection's backend, from a request's context.
Resolve = Callable[[Context], Backend]
# (tool, outcome): ok, error (a result the model reads) or failed (an MCP error).
Counted = Callable[[str, str], None]


class Offload(Protocol):
    """Runs a blocking backend call off the event loop."""

    def __call__(self, run: Callable[[], T], /) -> Awaitable[T]: ...


FROZEN_BLOCK = types.Resource(
    uri=FROZEN_BLOCK_URI,
    name="frozen-block",
    title="Memory block for the system prompt",
    description="This session's frozen memory block (agent notes and user profile), "
    "byte-identical until a write refreshes it; InjectForTurn's system_block.",
    mime_type="text/plain",
)
MEMORY_CONTEXT = types.Prompt(
    name=PROMPT,
    title="Memories relevant to a message",
    description="The stored memories relevant to the user's message that the frozen block "
    "does not show (InjectForTurn's turn_context), as one user message; no message at all "
    "when there is nothing to add.",
    arguments=[
        types.PromptArgument(
            name=PROMPT_ARGUMENT, description="The user's message this turn answers.", required=True
        )
    ],
)


def _invalid(message: str, **data: str) -> MCPError:
    return MCPError(types.INVALID_PARAMS, message, data)


def to_mcp_error(exc: SidecarError) -> MCPError:
    """The JSON-RPC error for a SidecarError, with what ErrorInfo would carry."""
    data = {"code": exc.code, "reason": exc.reason, "metadata": exc.metadata}
    return MCPError(_CODES.get(exc.code, types.INTERNAL_ERROR), exc.message, data)


def _tool(definition: ToolDef) -> types.Tool:
    return types.Tool(
        name=definition.name,
        description=definition.description,
        input_schema=definition.input_schema,
        annotations=_ANNOTATIONS.get(definition.name),
    )


def _text(text: str) -> types.TextContent:
    return types.TextContent(type="text", text=text)


async def _worker_thread(run: Callable[[], T]) -> T:
    return await anyio.to_thread.run_sync(run)


async def _list_resources(ctx: Context, params: types.PaginatedRequestParams | None) -> Any:
    return types.ListResourcesResult(resources=[FROZEN_BLOCK])


async def _list_prompts(ctx: Context, params: types.PaginatedRequestParams | None) -> Any:
    return types.ListPromptsResult(prompts=[MEMORY_CONTEXT])


class _Handlers:
    """The handlers that reach a backend: each finds the request's with
    `resolve` and runs its blocking call through `offload`."""

    def __init__(self, resolve: Resolve, count: Counted, offload: Offload) -> None:
        self._resolve = resolve
        self._count = count
        self._offload = offload

    async def _answer(self, run: Callable[[], T]) -> T:
        """`run`'s result off the event loop; a SidecarError as its MCP error,
        anything else unexpected as INTERNAL_ERROR (logged)."""
        try:
            return await self._offload(run)
        except SidecarError as exc:
            raise to_mcp_error(exc) from None
        except MCPError:
            raise
        except Exception:
            # The exception's text stays in the log, as for a gRPC call.
            log.exception("unhandled error in an MCP request")
            raise MCPError(
                types.INTERNAL_ERROR, "internal error; the sidecar's log has the details"
            ) from None

    async def list_tools(self, ctx: Context, params: types.PaginatedRequestParams | None) -> Any:
        backend = self._resolve(ctx)
        definitions = await self._answer(backend.definitions)
        return types.ListToolsResult(tools=[_tool(d) for d in definitions])

    async def call_tool(self, ctx: Context, params: types.CallToolRequestParams) -> Any:
        backend = self._resolve(ctx)
        label = params.name if params.name in TOOL_NAMES else "unknown"
        arguments = params.arguments or {}
        try:
            result = await self._answer(lambda: backend.call(params.name, arguments))
        except MCPError:
            self._count(label, "failed")
            raise
        self._count(label, "error" if result.is_error else "ok")
        # The wire form of a CallToolResult, as a dict: the SDK validates a
        # result against the protocol's schema either way, and a model would
        # only be built here to be dumped back to this dict (make bench, 17).
        return {
            "content": [{"type": "text", "text": result.text}],
            "structuredContent": result.structured,
            "isError": result.is_error,
            "resultType": "complete",
        }

    async def read_resource(self, ctx: Context, params: types.ReadResourceRequestParams) -> Any:
        if params.uri != FROZEN_BLOCK_URI:
            raise _invalid(
                f"no resource {params.uri!r}; the one resource is {FROZEN_BLOCK_URI}",
                uri=params.uri,
            )
        backend = self._resolve(ctx)
        block = await self._answer(backend.frozen_block)
        text = types.TextResourceContents(uri=FROZEN_BLOCK_URI, mime_type="text/plain", text=block)
        return types.ReadResourceResult(contents=[text])

    async def get_prompt(self, ctx: Context, params: types.GetPromptRequestParams) -> Any:
        if params.name != PROMPT:
            raise _invalid(
                f"no prompt {params.name!r}; the one prompt is {PROMPT}", name=params.name
            )
        message = (params.arguments or {}).get(PROMPT_ARGUMENT)
        if message is None:
            raise _invalid(
                f"{PROMPT} needs the argument {PROMPT_ARGUMENT}", argument=PROMPT_ARGUMENT
            )
        backend = self._resolve(ctx)
        turn = await self._answer(lambda: backend.turn_context(message))
        if not turn.strip():
            # Nothing to add: no message, rather than one with an empty text
            # block, which a model's API may refuse (Anthropic's does). The
            # frozen block is not sent instead: the host has it already.
            return types.GetPromptResult(description=NOTHING_TO_ADD, messages=[])
        return types.GetPromptResult(
            description="Memories relevant to this message",
            messages=[types.PromptMessage(role="user", content=_text(turn))],
        )


def _without_sdk_spans(server: Server[Any]) -> None:
    """The SDK's span per message goes to OpenTelemetry's global tracer
    provider, which the daemon never installs (sidecar.api.tracing keeps its
    own): a span nobody records, at a cost on every call. Opted out as the
    SDK documents (Server.middleware; the class is not exported by name)."""
    server.middleware = [
        m for m in server.middleware if type(m).__name__ != "OpenTelemetryMiddleware"
    ]


def build(
    resolve: Resolve,
    *,
    counted: Counted | None = None,
    offload: Offload = _worker_thread,
    get_tool_input_schema: Callable[[str], Mapping[str, Any] | None] | None = None,
) -> Server[Any]:
    """The MCP server over the backend `resolve` finds for each request.

    `offload` runs the backend's blocking calls (the engine's locks and
    queries, or a gRPC call) outside the event loop. `get_tool_input_schema`
    spares the SDK a tools/list of its own before each 2026-07-28 tools/call
    (it checks Mcp-Param headers against the schema).
    """
    handlers = _Handlers(resolve, counted or (lambda tool, outcome: None), offload)
    server: Server[Any] = Server(
        "memory-sidecar",
        version=__version__,
        title="memory-sidecar",
        instructions=INSTRUCTIONS,
        get_tool_input_schema=get_tool_input_schema,
        on_list_tools=handlers.list_tools,
        on_call_tool=handlers.call_tool,
        on_list_resources=_list_resources,
        on_read_resource=handlers.read_resource,
        on_list_prompts=_list_prompts,
        on_get_prompt=handlers.get_prompt,
    )
    _without_sdk_spans(server)
    return server
