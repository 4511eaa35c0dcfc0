"""The compact index's persisted form (sidecar.retrieval.index_format): one damaged,
foreign or of another format is refused.

Its round trip (persisted and restored, as of now and as of a start plus
the writes since) is checked in tests/retrieval/test_compact.py, beside the ranking it
must give.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable

import numpy as np
import pytest

from bench.agent_notes import previous_terms
from sidecar.core.memory import Memory, Tier, Usage
from sidecar.retrieval import index_format
from sidecar.retrieval.keywords import terms
from sidecar.storage.index import IndexSource
from tests.retrieval.test_compact import START, Twin


@pytest.mark.parametrize(
    "damage",
    [
        lambda a: a.update(positions=a["positions"] + 1000),
        lambda a: a.update(counts=np.zeros_like(a["counts"])),
        lambda a: a.update(tokenizer=np.frombuffer(b"another", dtype=np.uint8)),
        lambda a: a.update(version=np.array([99])),
        lambda a: a.update(seq=a["seq"][::-1].copy()),
        lambda a: a.update(offsets=a["offsets"][:-1].copy()),
        lambda a: a.pop("hashes"),
        lambda a: a.update(offsets=np.zeros(0, dtype=np.int64)),
        lambda a: a.update(categories=np.frombuffer(b"[" * 100_000, dtype=np.uint8)),
        lambda a: a.update(categories=np.frombuffer(b"7", dtype=np.uint8)),
    ],
    ids=[
        "positions", "counts", "tokenizer", "version", "seq order", "offsets", "member",
        "no offsets", "deep categories", "categories",
    ],
)  # fmt: skip
def test_a_damaged_or_foreign_index_is_refused(
    damage: Callable[[dict[str, object]], None], request: pytest.FixtureRequest
) -> None:
    """Damage raises ValueError, an index another version made (its
    tokeniser or format) ForeignIndex: sidecar.domain.index drops only the first."""
    memories = [
        Memory(f"m{k}", Tier.MEMORY, f"note {k} on deploys", "", 1.0, START, START, seq=k)
        for k in range(1, 30)
    ]
    twin = Twin(memories)
    with np.load(io.BytesIO(index_format.to_bytes(twin.compact)), allow_pickle=False) as saved:
        arrays = {name: saved[name] for name in saved.files}
    damage(arrays)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    source = IndexSource(
        buffer.getvalue(), 1, [], [], Usage.of(len(m.content) for m in memories), 1, 0
    )
    with pytest.raises(ValueError, match=r"unexpected|tokeniser|format|inconsistent") as raised:
        index_format.restore(Tier.MEMORY, "a", source, twin._fetch)
    foreign = request.node.callspec.id in ("tokenizer", "version")
    assert isinstance(raised.value, index_format.ForeignIndex) == foreign


def test_an_index_the_tokeniser_before_short_terms_made_is_foreign() -> None:
    """Indexed by the tokeniser that dropped short words and identifiers, a
    persisted index would find nothing for "uv" or "svc-7": its fingerprint
    is not this tokeniser's, so it is not read (the tier is indexed from its
    rows, and the index left for the version that made it)."""
    previous = hashlib.sha256("\n".join(previous_terms(index_format._PROBE)).encode())
    assert previous.hexdigest() != index_format.tokenizer()
    for term in ("uv", "gh", "s3", "42", "svc-7", "3.11", "pyproject.toml", "no-cache"):
        assert term in terms(index_format._PROBE), term
    memories = [
        Memory(f"m{k}", Tier.MEMORY, f"svc-{k} uses uv", "", 1.0, START, START, seq=k)
        for k in range(1, 30)
    ]
    twin = Twin(memories)
    with np.load(io.BytesIO(index_format.to_bytes(twin.compact)), allow_pickle=False) as saved:
        arrays = {name: saved[name] for name in saved.files}
    arrays["tokenizer"] = np.frombuffer(previous.hexdigest().encode(), dtype=np.uint8)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    source = IndexSource(
        buffer.getvalue(), 1, [], [], Usage.of(len(m.content) for m in memories), 1, 0
    )
    with pytest.raises(index_format.ForeignIndex):
        index_format.restore(Tier.MEMORY, "a", source, twin._fetch)


@pytest.mark.parametrize(("entries", "logged"), [(28, 0), (20, 8)])
def test_an_index_of_more_entries_than_the_tier_had_is_refused(entries: int, logged: int) -> None:
    """It holds 29 entries; the tier has `entries` now, and `logged` changes
    since the index: it can have held at most their sum."""
    memories = [
        Memory(f"m{k}", Tier.MEMORY, f"note {k} on deploys", "", 1.0, START, START, seq=k)
        for k in range(1, 30)
    ]
    twin = Twin(memories)
    data = index_format.to_bytes(twin.compact)
    source = IndexSource(data, 1, [], [], Usage(0, entries), 1, logged)
    with pytest.raises(ValueError, match=r"seq declares \(29,\) .* \(at most 28\)"):
        index_format.restore(Tier.MEMORY, "a", source, twin._fetch)
    enough = IndexSource(data, 1, [], [], Usage(0, entries + 1), 1, logged)
    assert index_format.restore(Tier.MEMORY, "a", enough, twin._fetch).count == 29


def test_a_truncated_or_foreign_archive_is_refused() -> None:
    memories = [
        Memory(f"m{k}", Tier.MEMORY, f"note {k}", "", 1.0, START, START, seq=k) for k in range(1, 5)
    ]
    twin = Twin(memories)
    data = index_format.to_bytes(twin.compact)
    for damaged in (data[: len(data) // 2], b"not a zip", data[:-30] + bytes(30)):
        source = IndexSource(damaged, 1, [], [], Usage(0, 4), 1, 0)
        with pytest.raises(ValueError, match=r"not an index archive|cut short|header"):
            index_format.restore(Tier.MEMORY, "a", source, twin._fetch)
