"""The store's hot-path statements: rendered by Peewee once, run many times.

Private to the storage modules (see sidecar.storage.store).

Owns: Record (a row as the hot paths read it) and record_of (a memory as that
row), Template, and the store's hot-path statements, by-seq lookups padded to a
power of two. Must not touch: a connection or a transaction (it renders SQL, the
store runs it) or any sidecar module but the vocabulary (memory, clock).
Not quite private: sidecar.retrieval.compact imports Record and record_of.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from sidecar.core.clock import to_micros
from sidecar.core.memory import Memory


class Record(NamedTuple):
    """A `memories` row as the hot paths read it (same names as the store's model fields)."""

    seq: int
    memory_id: str
    tier: str
    owner: str
    content: str
    content_chars: int
    category: str
    confidence: float
    created_at: int
    updated_at: int
    # Microseconds like created_at; None: never expires (schema 7).
    expires_at: int | None = None


def record_of(memory: Memory, owner: str = "") -> Record:
    """The row a memory was read from (or is restored as: the store draws
    the seq of a new row)."""
    return Record(
        memory.seq,
        memory.id,
        memory.tier.value,
        owner,
        memory.content,
        len(memory.content),
        memory.category,
        memory.confidence,
        to_micros(memory.created_at),
        to_micros(memory.updated_at),
        to_micros(memory.expires_at) if memory.expires_at else None,
    )


# Where a statement's `now` goes: rows with expires_at <= now are left out
# (an expired entry is never read back). 0 keeps them all (every expiry is
# after 1970).
KEEP_EXPIRED = 0
# The sentinel a Template's `now` is rendered with.
_NOW = -1_000_005


def unexpired(Row: Any, now: object) -> Any:  # noqa: N803 - a bound model class
    """The condition "not expired by `now`" (microseconds, or a sentinel): the
    one spelling every read of `memories` that hides expired rows uses."""
    return Row.expires_at.is_null() | (Row.expires_at > now)


class Template:
    """One statement rendered by Peewee once, run many times with new values.

    Rendering a query through Peewee costs more than SQLite takes to run it
    (about 0.6 ms of a 1 ms write), and the hot-path statements never change
    shape. The query is built with a distinct sentinel per value; the
    rendered SQL is kept, with where each named value goes among the
    parameters. The SQL is still Peewee's, for whichever backend it targets.
    """

    def __init__(self, query: Any, sentinels: Mapping[str, object]) -> None:
        self.sql, params = query.sql()
        names = {value: name for name, value in sentinels.items()}
        self._slots: list[tuple[str | None, object]] = [
            (names[p], None) if p in names else (None, p) for p in params
        ]

    def params(self, **values: object) -> list[object]:
        return [values[name] if name else literal for name, literal in self._slots]


class Statements:
    """The hot paths' statements for one bound model."""

    def __init__(self, Row: Any) -> None:  # noqa: N803 - a bound model class
        columns = [getattr(Row, name) for name in Record._fields]
        self._row, self._columns = Row, columns
        self._by_seqs: dict[int, Template] = {}
        scope = (Row.owner == "\x00owner") & (Row.tier == "\x00tier")
        marks = {"owner": "\x00owner", "tier": "\x00tier"}
        live = unexpired(Row, _NOW)
        # An expired row a write left (its purge is bounded) is no twin.
        self.identical = Template(
            Row.select(*columns)
            .where(scope & (Row.content_sha256 == "\x00digest") & (Row.content == "\x00content"))
            .where(live)
            .order_by(Row.seq)
            .limit(1),
            {**marks, "digest": "\x00digest", "content": "\x00content", "now": _NOW},
        )
        self.partition = Template(
            Row.select(*columns).where(scope & live).order_by(Row.seq),
            {**marks, "now": _NOW},
        )
        self.by_id = Template(
            Row.select(*columns).where(Row.memory_id == "\x00id"), {"id": "\x00id"}
        )
        # Whether an id is taken (by any row, expired or not): no columns read.
        self.taken = Template(
            Row.select(Row.seq).where(Row.memory_id == "\x00id").limit(1), {"id": "\x00id"}
        )
        values = {
            "memory_id": "\x00id",
            "tier": "\x00tier",
            "owner": "\x00owner",
            "content": "\x00content",
            "content_chars": -1_000_001,
            "content_sha256": "\x00digest",
            "category": "\x00category",
            "confidence": -1.25,
            "created_at": -1_000_002,
            "updated_at": -1_000_003,
            "expires_at": -1_000_006,
            "written_for_user_id": "\x00writer",
            "written_in_session": "\x00session",
        }
        self.insert = Template(Row.insert(**values), values)
        self._insert_values = values
        self._insert_params = Row.insert(**values).sql()[1]
        self._inserts: dict[int, str] = {}
        changes = {
            "content": "\x00content",
            "content_chars": -1_000_001,
            "content_sha256": "\x00digest",
            "category": "\x00category",
            "confidence": -1.25,
            "updated_at": -1_000_003,
            "expires_at": -1_000_006,
        }
        self.update = Template(
            Row.update(**changes).where(Row.seq == -1_000_004), {**changes, "seq": -1_000_004}
        )
        self.delete = Template(Row.delete().where(Row.seq == -1_000_004), {"seq": -1_000_004})

    def insert_rows(self, count: int) -> str:
        """`insert` for `count` rows in one statement (a bulk write's): its
        parameters are each row's `insert.params`, one row after another."""
        sql = self._inserts.get(count)
        if sql is None:
            sql, params = self._row.insert_many([self._insert_values] * count).sql()
            if params != self._insert_params * count:  # pragma: no cover - Peewee's rendering
                raise RuntimeError("a multi-row insert's parameters are not row by row")
            self._inserts[count] = sql
        return sql

    def by_seqs(
        self, owner: str, tier: str, seqs: Sequence[int], now: int = KEEP_EXPIRED
    ) -> tuple[str, list[object]]:
        """One partition's rows with these seqs, but those expired by `now`.
        Lists are padded (repeating the last seq) to a power of two: few
        statement shapes, which the driver's prepared-statement cache keeps."""
        padded = 1 << max(len(seqs) - 1, 0).bit_length()
        seqs = [*seqs, *[seqs[-1]] * (padded - len(seqs))]
        template = self._by_seqs.get(len(seqs))
        if template is None:
            Row = self._row  # noqa: N806 - a bound model class
            marks = {f"s{i}": -2_000_000 - i for i in range(len(seqs))}
            template = Template(
                Row.select(*self._columns).where(
                    (Row.owner == "\x00owner")
                    & (Row.tier == "\x00tier")
                    & Row.seq.in_(list(marks.values()))
                    & unexpired(Row, _NOW)
                ),
                {"owner": "\x00owner", "tier": "\x00tier", "now": _NOW, **marks},
            )
            self._by_seqs[len(seqs)] = template
        values = {f"s{i}": seq for i, seq in enumerate(seqs)}
        return template.sql, template.params(owner=owner, tier=tier, now=now, **values)
