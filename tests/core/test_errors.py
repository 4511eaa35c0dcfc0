"""The reasons clients read: defined once, spelled as they always were, and
raised through the leaf a caller branches on."""

from __future__ import annotations

import inspect
import io
import re
import tokenize
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from sidecar.api.interceptors import to_status
from sidecar.core import errors
from sidecar.core.errors import (
    DatabaseBusy,
    DatabaseIOError,
    DatabaseReadOnly,
    DatabaseRefused,
    DatabaseUnavailable,
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    MatchNotFound,
    NotFound,
    PageTokenMismatch,
    Reason,
    ResourceExhausted,
    SidecarError,
    StorageFull,
    StoreError,
    Unavailable,
)

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [
    path
    for path in sorted((ROOT / "sidecar").rglob("*.py"))
    if "_proto" not in path.parts and path != ROOT / "sidecar" / "core" / "errors.py"
]
# Status-code names are spelled out where a code is mapped (MCP, HTTP); a few
# are reasons too (INVALID_ARGUMENT, UNAVAILABLE, ...).
CODE_NAMES = {code.name for code in grpc.StatusCode}
DETAILS_KEY = "grpc-status-details-bin"


def _leaves() -> list[type[SidecarError]]:
    return [
        cls
        for _, cls in inspect.getmembers(errors, inspect.isclass)
        if issubclass(cls, SidecarError)
    ]


def test_every_reason_is_spelled_as_its_name() -> None:
    # auto() would lower-case them; clients compare these bytes.
    assert [reason.value for reason in Reason] == [reason.name for reason in Reason]
    assert all(re.fullmatch(r"[A-Z][A-Z0-9_]+", reason.value) for reason in Reason)


# (leaf, its status's class, status code, reason), as the status mapping has
# always answered for these errors.
TYPED = [
    (MatchNotFound, NotFound, "NOT_FOUND", "MATCH_NOT_FOUND"),
    (PageTokenMismatch, InvalidArgument, "INVALID_ARGUMENT", "PAGE_TOKEN_MISMATCH"),
    (StoreError, FailedPrecondition, "FAILED_PRECONDITION", "STORE_UNUSABLE"),
    (DatabaseUnavailable, Unavailable, "UNAVAILABLE", "DATABASE_UNAVAILABLE"),
    (DatabaseRefused, Unavailable, "UNAVAILABLE", "DATABASE_UNAVAILABLE"),
    (DatabaseBusy, Unavailable, "UNAVAILABLE", "DATABASE_BUSY"),
    (DatabaseReadOnly, FailedPrecondition, "FAILED_PRECONDITION", "DATABASE_READ_ONLY"),
    (DatabaseIOError, Unavailable, "UNAVAILABLE", "DATABASE_IO_ERROR"),
    (StorageFull, ResourceExhausted, "RESOURCE_EXHAUSTED", "STORAGE_FULL"),
    (DataLoss, DataLoss, "DATA_LOSS", "DATABASE_CORRUPT"),
]


@pytest.mark.parametrize(
    ("leaf", "status_class", "code", "reason"), TYPED, ids=[row[0].__name__ for row in TYPED]
)
def test_a_typed_leaf_answers_its_status_and_reason(
    leaf: type[SidecarError], status_class: type[SidecarError], code: str, reason: str
) -> None:
    error = leaf("what happened", metadata={"n": 1})
    assert isinstance(error, status_class)
    assert type(error.reason) is str  # the value alone, never the enum
    status = to_status(error)
    assert (status.code, status.details) == (grpc.StatusCode[code], "what happened")
    details = status_pb2.Status.FromString(dict(status.trailing_metadata)[DETAILS_KEY])
    info = error_details_pb2.ErrorInfo()
    assert details.details[0].Unpack(info)
    assert (info.reason, info.domain, dict(info.metadata)) == (reason, "memory.v1", {"n": "1"})


def test_a_reason_passed_at_a_raise_site_keeps_its_class() -> None:
    error = Unavailable("down", reason=Reason.REPLICA_BEHIND)
    assert (error.code, error.reason, type(error.reason)) == ("UNAVAILABLE", "REPLICA_BEHIND", str)
    # As a remote daemon answered it (the stdio bridge): kept as it came.
    assert NotFound("gone", reason="SOME_NEWER_REASON").reason == "SOME_NEWER_REASON"
    assert NotFound("gone", reason="").reason == "MEMORY_NOT_FOUND"


def test_no_reason_is_spelled_outside_the_errors_module() -> None:
    reasons = {reason.value for reason in Reason} - CODE_NAMES
    spelled = []
    for path in SOURCES:
        tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
        for token in tokens:
            if token.type != tokenize.STRING:
                continue
            text = re.sub(r"^[rbuRBUfF]*(['\"])(.*)\1$", r"\2", token.string)
            if text in reasons:
                spelled.append(f"{path.relative_to(ROOT)}:{token.start[0]}: {text}")
    assert spelled == [], "use sidecar.core.errors.Reason"


def test_a_leafs_reason_is_raised_as_that_leaf() -> None:
    # reason=Reason.DATABASE_BUSY on an Unavailable would escape every
    # `except DatabaseBusy`: a reason with a leaf of its own is never passed.
    # (A status class's own default, as ResourceExhausted's, may be named.)
    own = {cls.default_reason.name for cls in _leaves() if cls.__base__ is not SidecarError}
    passed = []
    for path in SOURCES:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for name in re.findall(r"reason=Reason\.([A-Z0-9_]+)", line):
                if name in own:
                    passed.append(f"{path.relative_to(ROOT)}:{number}: {name}")
    assert passed == []


def _documented_reasons() -> set[str]:
    """The reasons docs/API.md's tables name (error, expiry and tool tables)."""
    found: set[str] = set()
    column = None
    for line in (ROOT / "docs" / "API.md").read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if not line.startswith("|"):
            column = None
        elif column is None:
            column = cells.index("reason") if "reason" in cells else -1
        elif column >= 0 and not cells[column].startswith(("any other", "---")):
            found.update(re.findall(r"`([A-Z][A-Z0-9_]+)`", cells[column]))
    return found


def test_the_documented_reasons_are_the_defined_ones() -> None:
    documented = _documented_reasons()
    assert len(documented) > 50
    assert sorted(documented - set(Reason.__members__)) == []
