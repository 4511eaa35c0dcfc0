"""ExportMemories over gRPC: check the request, stream the JSONL, say where
each batch ends.

A stream reads one snapshot (sidecar.storage.archive.exported: one read
transaction) and sends the entries in insertion order, `batch_size` lines a
response at most, and fewer when the next line would take the response past
server.max_response_bytes. Each response's cursor is a page token
(sidecar.api.paging) bound to the request's scope, tiers and for_user, holding
the last seq sent of each partition: a stream resumed from it sends, of each
partition, what follows that partition's seq, as of a new snapshot (what was
committed meanwhile after the cursor is included, what was deleted before it
is not repeated). One seq per partition, not one for the stream: seqs are
drawn before commit, so on PostgreSQL a write to one tier may commit after a
larger seq of the other tier was sent, and a single seq would skip it. Within
a partition seqs commit in order (every insert holds the partition's state
row lock until it commits; SQLite has one writer at all), so a partition's
last seq sent is exact. A cursor of one seq (issued before) is read as that
seq for every partition. A cursor of another request, or garbage, is
INVALID_ARGUMENT (CURSOR_INVALID).

A stream over a partition erased while it runs (ForgetUser, DeleteScope)
ends with ABORTED (SCOPE_ERASED) at its next response: its snapshot still
holds the erased entries (sidecar.domain.export).

A client that cancels, or whose deadline passes, stops the stream at the
next response: the generator is closed on the worker thread that ran it, so
the read transaction ends and the connection goes back to the pool.

Owns: ExportMemories' request checks (scope and grant, for_user, batch
size, cursor) and its responses. Must not touch: the store or SQL (only
MemoryEngine's exports), statuses (sidecar.api.interceptors maps errors).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from typing import Any

from sidecar._proto.memory.v1 import memory_pb2 as pb
from sidecar.api import access, paging
from sidecar.core.errors import Aborted, InvalidArgument, PageTokenMismatch, Reason
from sidecar.core.limits import Limits, checked
from sidecar.core.memory import Memory, Scope, Tier
from sidecar.domain.engine import MemoryEngine
from sidecar.domain.export import Partition
from sidecar.storage import archive

DEFAULT_BATCH = 500
# A response of 1,000 short lines is ~300 KB: larger batches save nothing
# measurable (bench section 21) and hold more rows per partition.
MAX_BATCH = 1000
# Room in a response for the cursor and the counts.
_RESERVE = 512
_KIND = "export"


def _wanted(context: Any) -> bool:
    """Whether the caller still waits: not cancelled, deadline not passed."""
    remaining = context.time_remaining()
    return bool(context.is_active()) and (remaining is None or remaining > 0)


def _cursor(pages: paging.PageTokens, token: str, bound_to: str, count: int) -> list[int]:
    """The seq a cursor ends at in each of the `count` partitions; 0s for
    none (the start)."""
    try:
        return pages.decode_positions(token, _KIND, bound_to, count)
    except InvalidArgument as exc:
        raise InvalidArgument(
            "cursor belongs to an export of other fields; resume with the scope, tier and "
            "for_user of the request that returned it"
            if isinstance(exc, PageTokenMismatch)
            else "cursor is not one this server issued; pass the cursor of the last "
            "response received, unchanged",
            reason=Reason.CURSOR_INVALID,
        ) from None


def _check_erasure(erased: Partition | None) -> None:
    """ABORTED (SCOPE_ERASED) once a partition the stream reads was erased:
    its snapshot still holds the erased entries, which must not be sent."""
    if erased is not None:
        owner, tier = erased
        raise Aborted(
            f"the {tier.value} tier of {owner!r} was erased (ForgetUser or DeleteScope) while "
            "this export ran; drop what was received of it, and export again for what is left",
            reason=Reason.SCOPE_ERASED,
            metadata={"owner": owner, "tier": tier.value},
        )


class _Position:
    """Where a stream stands: the last seq sent of each partition, in the
    request's order (what its cursor holds)."""

    def __init__(self, partitions: list[Partition], after: list[int]) -> None:
        self._index = {partition: i for i, partition in enumerate(partitions)}
        self.seqs = after

    def sent(self, owner: str, memory: Memory) -> None:
        key = (owner, memory.tier)
        if memory.written_for is not None:
            # A note read as written for the user: that pseudo-partition's.
            key = archive.written_for(memory.written_for)
        self.seqs[self._index[key]] = memory.seq


class ExportStream:
    """The ExportMemories handler MemoryService delegates to."""

    def __init__(
        self,
        engine: MemoryEngine,
        limits: Limits,
        read_tiers: Callable[[int], tuple[Tier, ...]],
        pages: paging.PageTokens,
    ) -> None:
        self._engine = engine
        self._limits = limits
        self._pages = pages
        # service.read_tiers, handed in: this module sits beside the service
        # and may not import it back.
        self._read_tiers = read_tiers

    def _partitions(self, request: pb.ExportMemoriesRequest) -> tuple[list[Partition], str]:
        """What to export, checked against the caller's grant, and the
        digest its cursors are bound to."""
        limit = self._limits.id_chars
        scope = Scope(
            agent_id=checked("scope.agent_id", request.scope.agent_id, limit),
            user_id=checked("scope.user_id", request.scope.user_id, limit),
        )
        tiers = self._read_tiers(request.tier)
        if request.for_user:
            if scope.agent_id:
                raise InvalidArgument(
                    "for_user exports the user's profile whatever the agent: leave "
                    "scope.agent_id empty",
                    reason=Reason.FOR_USER_WITH_AGENT,
                    metadata={"field": "scope.agent_id"},
                )
            if Tier.USER not in tiers:
                raise InvalidArgument(
                    "for_user exports the user tier: leave tier unspecified or TIER_USER",
                    reason=Reason.FOR_USER_TIER,
                    metadata={"field": "tier"},
                )
            access.authorize_user(scope.user_id)
        else:
            access.authorize(scope)
        partitions = self._engine.export_partitions(scope, tiers, for_user=request.for_user)
        return partitions, paging.digest(_KIND, partitions)

    def __call__(
        self, request: pb.ExportMemoriesRequest, context: Any
    ) -> Iterator[pb.ExportMemoriesResponse]:
        partitions, bound_to = self._partitions(request)
        after = _cursor(self._pages, request.cursor, bound_to, len(partitions))
        if request.batch_size < 0:
            raise InvalidArgument(
                f"batch_size must not be negative, got {request.batch_size}",
                reason=Reason.BATCH_SIZE_OUT_OF_RANGE,
                metadata={"batch_size": request.batch_size},
            )
        batch = min(request.batch_size or DEFAULT_BATCH, MAX_BATCH)
        with self._engine.exporting(partitions) as erased_since:
            entries = self._engine.export_entries(partitions, list(after), batch)
            try:
                yield from self._responses(
                    entries, _Position(partitions, after), batch, bound_to, context, erased_since
                )
            finally:
                # Ends the read transaction now, on this thread, however
                # the stream ended (done, cancelled, an error).
                entries.close()

    def _responses(
        self,
        entries: Generator[tuple[str, Memory]],
        after: _Position,
        batch: int,
        bound_to: str,
        context: Any,
        erased_since: Callable[[], Partition | None],
    ) -> Iterator[pb.ExportMemoriesResponse]:
        budget = self._limits.response_bytes - _RESERVE
        # One entry read ahead: whether the response being filled is the last.
        pending = next(entries, None)
        while True:
            if not _wanted(context):
                return
            _check_erasure(erased_since())
            lines: list[str] = []
            used = 0
            while pending is not None and len(lines) < batch:
                owner, memory = pending
                line = archive.export_line(owner, memory) + "\n"
                size = len(line) if line.isascii() else len(line.encode())
                # A response's first line always goes, or a huge entry
                # could never be exported.
                if lines and used + size > budget:
                    break
                lines.append(line)
                used += size
                after.sent(owner, memory)
                pending = next(entries, None)
            done = pending is None
            yield pb.ExportMemoriesResponse(
                jsonl="".join(lines),
                count=len(lines),
                cursor=self._pages.encode(_KIND, bound_to, after.seqs),
                done=done,
            )
            if done:
                return
