"""Operator commands: talk to a running daemon, or work on the database file.

Online (over gRPC, to --address): add, list, search, update, rm, usage,
inject, and export with --address (ExportMemories, resumed after a cut).
Offline (on --db, safe while the daemon runs): backup, export, import, check,
audit.

Owns: the operator commands' behaviour and output: online ones as gRPC clients
(errors, the health check; their channel is sidecar.ops.channel's), offline
ones on a Store (verified backup, export and import in sidecar.storage.archive's JSON-lines
format, check, the erasure audit log).
Must not touch: the engine, SQL (all through Store), os.environ.
index_large_tiers takes sidecar.domain.index's log-then-save steps itself
(sidecar.retrieval.index_format), synchronously and reporting a refused write,
where the daemon saves in the background.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Iterable, Iterator
from datetime import UTC
from typing import Any, TextIO

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.json_format import MessageToDict
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar._proto.memory.v1 import memory_pb2_grpc as pb_grpc
from sidecar.config.settings import Config
from sidecar.core.clock import from_micros, parse_timestamp, to_micros
from sidecar.core.errors import InvalidArgument, Reason, SidecarError
from sidecar.core.memory import Memory, Tier
from sidecar.ops.channel import online_channel
from sidecar.ops.console import Progress, emit_json, table
from sidecar.storage import archive
from sidecar.storage.archive import export_line, iso_time, parse_line
from sidecar.storage.schema import SCHEMA_VERSION
from sidecar.storage.store import Store

TIERS = {"memory": pb.TIER_MEMORY, "user": pb.TIER_USER, "both": pb.TIER_UNSPECIFIED}


class CommandFailed(SidecarError):
    """An RPC failed; the message says which and why."""


# --- online ------------------------------------------------------------------


_INT64 = frozenset(
    {
        FieldDescriptor.TYPE_INT64,
        FieldDescriptor.TYPE_UINT64,
        FieldDescriptor.TYPE_SINT64,
        FieldDescriptor.TYPE_FIXED64,
        FieldDescriptor.TYPE_SFIXED64,
    }
)


def _numbers(message: Any, value: dict[str, Any]) -> dict[str, Any]:
    """64-bit integers as JSON numbers: protobuf's JSON mapping writes them
    as strings (for JavaScript's sake), which scripts then have to convert."""
    for field in message.DESCRIPTOR.fields:
        if field.name not in value:
            continue
        repeated = field.is_repeated
        if field.type in _INT64:
            item = value[field.name]
            value[field.name] = [int(i) for i in item] if repeated else int(item)
        elif field.type == FieldDescriptor.TYPE_MESSAGE and isinstance(
            value[field.name], dict | list
        ):
            children = getattr(message, field.name)
            if repeated:
                for child, child_value in zip(children, value[field.name], strict=True):
                    if isinstance(child_value, dict):
                        _numbers(child, child_value)
            else:
                _numbers(children, value[field.name])
    return value


def _as_dict(message: Any) -> dict[str, Any]:
    result: dict[str, Any] = MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    return _numbers(message, result)


def _when(stamp: Any) -> str:
    return str(stamp.ToDatetime(tzinfo=UTC).strftime("%Y-%m-%d %H:%M"))


def _memory_rows(memories: list[Any]) -> list[list[object]]:
    return [
        [
            m.id,
            pb.Tier.Name(m.tier).removeprefix("TIER_").lower(),
            m.category or "-",
            f"{m.confidence:.2f}",
            _when(m.updated_at),
            m.content,
        ]
        for m in memories
    ]


_MEMORY_HEADERS = ("ID", "TIER", "CATEGORY", "CONF", "UPDATED", "CONTENT")


def _usage_rows(usage: list[Any]) -> list[list[object]]:
    rows: list[list[object]] = []
    for u in usage:
        limit = f"{u.limit_chars:,}" if u.limit_chars else "unlimited"
        share = f"{u.used_chars * 100 // u.limit_chars}%" if u.limit_chars else "-"
        rows.append(
            [
                pb.Tier.Name(u.tier).removeprefix("TIER_").lower(),
                f"{u.used_chars:,}",
                limit,
                share,
                u.entry_count,
                "yes" if u.enabled else "no",
            ]
        )
    return rows


_USAGE_HEADERS = ("TIER", "USED", "LIMIT", "SHARE", "ENTRIES", "ENABLED")


class Online:
    """One command against the daemon's API."""

    def __init__(self, args: argparse.Namespace, config: Config, out: TextIO) -> None:
        self.args = args
        self.out = out
        self.address = args.address or config.server.listen
        self.scope = pb.Scope(agent_id=args.agent_id, user_id=args.user_id)
        self.channel = online_channel(self.address, args, config)
        self.stub = pb_grpc.MemoryServiceStub(self.channel)

    def call(self, method: str, request: Any) -> Any:
        try:
            # A daemon still starting is waited for, up to --timeout.
            return getattr(self.stub, method)(
                request, timeout=self.args.timeout, wait_for_ready=True
            )
        except grpc.RpcError as exc:
            raise self.failure(method, exc) from None

    def failure(self, method: str, exc: grpc.RpcError) -> CommandFailed:
        """What to tell the operator about a failed call."""
        code, reason = exc.code(), _reason(exc)
        # No reason: gRPC's own failure (nothing listening, or still
        # starting when --timeout ran out), not the daemon's answer.
        transport = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        if code in transport and not reason:
            return CommandFailed(
                f"cannot reach memory-sidecar at {self.address} within "
                f"{self.args.timeout:g} s: {exc.details()}"
            )
        if reason == Reason.MEMORY_NOT_FOUND and not (self.args.agent_id or self.args.user_id):
            return CommandFailed(
                f"{method} failed: no such memory in the default scope; memories live in "
                "their scope: pass --agent-id for agent notes, --user-id for the user profile"
            )
        shown = f" ({reason})" if reason else ""
        return CommandFailed(f"{method} failed: {code.name}{shown}: {exc.details()}")

    def run(self) -> int:
        try:
            return int(getattr(self, "do_" + self.args.command.replace("-", "_"))())
        finally:
            self.channel.close()

    def _show(self, response: Any, memories: list[Any], usage: list[Any]) -> int:
        if self.args.json:
            emit_json(_as_dict(response), self.out)
            return 0
        if memories:
            table(_MEMORY_HEADERS, _memory_rows(memories), self.out)
        if usage:
            if memories:
                print(file=self.out)
            table(_USAGE_HEADERS, _usage_rows(usage), self.out)
        return 0

    def do_add(self) -> int:
        request = pb.AddMemoryRequest(
            scope=self.scope,
            tier=TIERS[self.args.tier],
            content=self.args.content,
            category=self.args.category,
        )
        if self.args.confidence is not None:
            request.confidence = self.args.confidence
        response = self.call("AddMemory", request)
        if not self.args.json and not response.created:
            print("an identical entry exists already:", file=self.out)
        return self._show(response, [response.memory], [response.usage])

    def pages(self, method: str, request: Any, field: str) -> Any:
        """Every page of a paged call, merged into one response: the server
        keeps each page under its response limit, however long the list."""
        merged = None
        while True:
            response = self.call(method, request)
            if merged is None:
                merged = response
            else:
                getattr(merged, field).extend(getattr(response, field))
            if not response.next_page_token:
                merged.next_page_token = ""
                return merged
            request.page_token = response.next_page_token

    def do_list(self) -> int:
        response = self.pages(
            "GetMemories",
            pb.GetMemoriesRequest(
                scope=self.scope, tier=TIERS[self.args.tier], category=self.args.category
            ),
            "memories",
        )
        if not self.args.json and not response.memories:
            print("no memories in this scope", file=self.out)
        return self._show(response, list(response.memories), list(response.usage))

    def do_search(self) -> int:
        response = self.pages(
            "SearchMemories",
            pb.SearchMemoriesRequest(
                scope=self.scope,
                query=self.args.query,
                tier=TIERS[self.args.tier],
                category=self.args.category,
                limit=self.args.limit,
                match_all=self.args.all,
            ),
            "hits",
        )
        if self.args.json:
            emit_json(_as_dict(response), self.out)
        elif not response.hits:
            print("no matches", file=self.out)
        else:
            rows = [[f"{h.score:.3f}", *_memory_rows([h.memory])[0]] for h in response.hits]
            table(("SCORE", *_MEMORY_HEADERS), rows, self.out)
        return 0

    def do_update(self) -> int:
        if (
            self.args.content is None
            and self.args.category is None
            and (self.args.confidence is None)
        ):
            raise CommandFailed("update needs --content, --category or --confidence")
        request = pb.UpdateMemoryRequest(scope=self.scope, id=self.args.id)
        if self.args.content is not None:
            request.content = self.args.content
        if self.args.category is not None:
            request.category = self.args.category
        if self.args.confidence is not None:
            request.confidence = self.args.confidence
        response = self.call("UpdateMemory", request)
        return self._show(response, [response.memory], [response.usage])

    def do_rm(self) -> int:
        response = self.call(
            "DeleteMemory", pb.DeleteMemoryRequest(scope=self.scope, id=self.args.id)
        )
        if not self.args.json:
            print("removed:", file=self.out)
        return self._show(response, [response.memory], [response.usage])

    def do_usage(self) -> int:
        # Usage comes with every page: the smallest page will do.
        response = self.call("GetMemories", pb.GetMemoriesRequest(scope=self.scope, page_size=1))
        if self.args.json:
            emit_json({"usage": _as_dict(response)["usage"]}, self.out)
            return 0
        table(_USAGE_HEADERS, _usage_rows(list(response.usage)), self.out)
        return 0

    def do_inject(self) -> int:
        # A session of its own, ended afterwards, unless the operator names one:
        # looking must not disturb a runtime's snapshot.
        session = self.args.session or f"memory-sidecar-cli-{os.getpid()}"
        try:
            turn = self.call(
                "InjectForTurn",
                pb.InjectForTurnRequest(
                    scope=self.scope,
                    session_id=session,
                    user_message=self.args.message,
                    recent_messages=self.args.recent or [],
                ),
            )
        finally:
            if not self.args.session:
                self.call("EndSession", pb.EndSessionRequest(session_id=session, scope=self.scope))
        if self.args.json:
            emit_json(_as_dict(turn), self.out)
            return 0
        counter = pb.TokenCounter.Name(turn.token_counter).removeprefix("TOKEN_COUNTER_").lower()
        print(
            f"── system_block ({turn.system_block_tokens:,} tokens, {counter}, "
            f"generation {turn.snapshot_generation}, sha256 {turn.snapshot_sha256[:12]}) ──",
            file=self.out,
        )
        print(turn.system_block or "(empty)", file=self.out)
        print(f"── turn_context ({turn.turn_context_tokens:,} tokens) ──", file=self.out)
        print(turn.turn_context or "(empty)", file=self.out)
        return 0

    def do_export(self) -> int:
        """ExportMemories into a file (or stdout), resumed from the last
        cursor received when the stream is cut (UNAVAILABLE; CANCELLED, a
        graceful stop; EXPORTS_BUSY, the cut stream still holding its slot
        for a moment), at most --retries times in a row, backing off."""
        args = self.args
        request = pb.ExportMemoriesRequest(scope=self.scope, tier=TIERS[args.tier])
        if args.for_user is not None:
            request.for_user = True
            request.scope.user_id = args.for_user
        path = args.destination
        sink = self.out if path == "-" else open(path, "w", encoding="utf-8")  # noqa: SIM115
        progress = Progress("exporting")
        count, cuts = 0, 0
        try:
            while True:
                try:
                    # Waits up to --timeout for the daemon (to start, or to
                    # come back), but sets no deadline on the stream itself:
                    # an export takes as long as its size.
                    grpc.channel_ready_future(self.channel).result(timeout=args.timeout)
                    for response in self.stub.ExportMemories(request):
                        sink.write(response.jsonl)
                        count += response.count
                        progress.update(count)
                        # Only after the lines are written: a resume never
                        # skips a batch, nor writes one twice.
                        request.cursor = response.cursor
                        cuts = 0
                    break
                except grpc.FutureTimeoutError:
                    raise CommandFailed(
                        f"cannot reach memory-sidecar at {self.address} within "
                        f"{args.timeout:g} s"
                        + (f" ({count:,} memories written before the cut)" if count else "")
                    ) from None
                except grpc.RpcError as exc:
                    if not _resumable(exc):
                        raise self.failure("ExportMemories", exc) from None
                    if cuts >= args.retries:
                        raise CommandFailed(
                            f"ExportMemories was cut off {cuts + 1} times in a row, "
                            f"{count:,} memories written: {exc.details()}"
                        ) from None
                    cuts += 1
                    time.sleep(min(0.2 * 2**cuts, 5.0))
        finally:
            if sink is not self.out:
                sink.close()
            progress.done()
        if args.destination != "-":
            print(f"exported {count:,} memories to {args.destination}", file=self.out)
        return 0


def _reason(exc: grpc.RpcError) -> str:
    """The daemon's reason for a failed call ("" when gRPC's own)."""
    status = rpc_status.from_call(exc)
    for detail in status.details if status else ():
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return str(info.reason)
    return ""


def _resumable(exc: grpc.RpcError) -> bool:
    """Whether an export cut off this way may resume from its cursor."""
    code = exc.code()
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        return True
    return code == grpc.StatusCode.RESOURCE_EXHAUSTED and _reason(exc) == Reason.EXPORTS_BUSY


def health(args: argparse.Namespace, config: Config, out: TextIO) -> int:
    """Ask grpc.health.v1 for a status; for Docker's HEALTHCHECK and people."""
    address = args.address or config.server.health_listen or config.server.listen
    if address.startswith("0.0.0.0:"):
        address = "127.0.0.1:" + address.rpartition(":")[2]
    with grpc.insecure_channel(address) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
        except grpc.RpcError as exc:
            raise CommandFailed(f"health check of {address} failed: {exc.code().name}") from None
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    print(status, file=out)
    return 0 if response.status == health_pb2.HealthCheckResponse.SERVING else 1


# --- offline -----------------------------------------------------------------


def backup(store: Store, destination: str, out: TextIO) -> int:
    if os.path.exists(destination):
        raise InvalidArgument(
            f"{destination} exists; choose a new file", reason=Reason.BACKUP_TARGET_EXISTS
        )
    progress = Progress("backing up (pages)")
    archive.backup(store, destination, progress.update)
    progress.done()
    copy = Store(destination)
    try:
        version, verdict = copy.schema_version(), copy.integrity_check()
    finally:
        copy.close()
    print(
        f"backed up {store.path} to {destination} (schema {version}, integrity {verdict})", file=out
    )
    return 0


def export(store: Store, destination: str, out: TextIO) -> int:
    progress = Progress("exporting")
    sink = out if destination == "-" else open(destination, "w", encoding="utf-8")  # noqa: SIM115
    count = 0
    try:
        for owner, memory in archive.dump(store):
            print(export_line(owner, memory), file=sink)
            count += 1
            progress.update(count)
    finally:
        if sink is not out:
            sink.close()
    progress.done()
    if destination != "-":
        print(f"exported {count:,} memories to {destination}", file=out)
    return 0


def audit(store: Store, since: str, limit: int | None, out: TextIO) -> int:
    """The erasure audit log as JSON Lines, oldest first: every row at or
    after `since` (RFC 3339; naive means UTC), the newest `limit` of them."""
    moment = parse_timestamp(since) if since else None
    if since and moment is None:
        raise InvalidArgument(f"--since {since!r} is not a time like 2026-01-31T12:00:00Z")
    for row in store.erasure.audit_log(since=to_micros(moment) if moment else 0, limit=limit):
        line = {**dataclasses.asdict(row), "at": iso_time(from_micros(row.at))}
        print(json.dumps(line, ensure_ascii=False, sort_keys=True), file=out)
    return 0


def _read_lines(source: str) -> Iterator[tuple[str, Memory]]:
    handle = sys.stdin if source == "-" else open(source, encoding="utf-8")  # noqa: SIM115
    total = os.path.getsize(source) if source != "-" else None
    progress = Progress("importing (bytes)")
    read = 0
    try:
        for number, line in enumerate(handle, start=1):
            read += len(line.encode())
            progress.update(read, total)
            if line.strip():
                yield parse_line(number, line)
    finally:
        progress.done()
        if handle is not sys.stdin:
            handle.close()


def import_file(store: Store, source: str, out: TextIO, *, compact_from: int = 0) -> int:
    if source != "-" and not os.path.isfile(source):
        raise InvalidArgument(f"{source}: no such file", reason=Reason.IMPORT_SOURCE_MISSING)
    # Parse everything first: a bad line aborts the import before any write.
    entries = list(_read_lines(source))
    inserted, present = archive.restore(store, entries)
    print(f"imported {inserted:,} of {len(entries):,} memories", file=out)
    if present:
        print(f"skipped {len(present):,} whose id is already present", file=out)
    if inserted:
        index_large_tiers(store, {(m.tier, owner) for owner, m in entries}, compact_from, out)
    return 0


def index_large_tiers(
    store: Store, tiers: Iterable[tuple[Tier, str]], compact_from: int, out: TextIO
) -> None:
    """Index and persist the tiers a bulk write filled that the daemon holds
    compactly (`compact_tier_entries` and up). The bulk write dropped their
    persisted index; without this the daemon's first query after it would
    index every row (24-27 s at a million entries, docs/BENCHMARKS.md
    section 13) instead of reading the index (under 1 s)."""
    if not compact_from:
        return
    from sidecar.retrieval import index_format  # numpy: only an import that fills a large tier

    for tier, owner in sorted(tiers, key=lambda key: (key[1], key[0].value)):
        count, _ = store.tier_state(tier, owner)
        if count < compact_from:
            continue
        name = owner or "(default)"
        try:
            # Logged from before the rows are read, as the daemon does: a
            # write made meanwhile (a live daemon) is replayed on top of it.
            store.indexes.start_logging(tier, owner)
            saved = index_format.persist(store, index_format.from_rows(store, tier, owner))
        except SidecarError as exc:  # the import itself is committed
            print(f"not indexed: {tier.value} tier of {name!r}: {exc.message}", file=out)
            continue
        what = "indexed" if saved else "not indexed (a newer index is kept)"
        print(f"{what}: {tier.value} tier of {name!r}, {count:,} memories", file=out)


def check(store: Store, out: TextIO, as_json: bool) -> int:
    version = store.schema_version()
    verdict = store.integrity_check()
    counts = store.counts()
    if as_json:
        emit_json(
            {
                "path": store.path,
                "schema_version": version,
                "expected_schema": SCHEMA_VERSION,
                "integrity": verdict,
                "entries": [
                    {"tier": t.value, "owner": o, "count": n}
                    for (t, o), n in sorted(
                        counts.items(), key=lambda kv: (kv[0][1], kv[0][0].value)
                    )
                ],
            },
            out,
        )
    else:
        print(f"database   {store.path}", file=out)
        print(f"schema     {version} (this memory-sidecar writes {SCHEMA_VERSION})", file=out)
        print(f"integrity  {verdict}", file=out)
        print(
            f"entries    {sum(counts.values()):,} in {len(counts):,} tier(s) of "
            f"{len({o for _, o in counts}):,} owner(s)",
            file=out,
        )
    return 0 if verdict == "ok" and version == SCHEMA_VERSION else 1
