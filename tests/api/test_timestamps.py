"""Entries' times as protobuf Timestamps (sidecar.api.service.memory_pb):
the same values Timestamp.FromDatetime gives, aware or naive (UTC)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from sidecar.api.service import _timestamp

MOMENTS = [
    datetime(2026, 11, 29, 13, 17, 35, 123456, tzinfo=UTC),
    datetime(1970, 1, 1, tzinfo=UTC),
    datetime(1969, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
    datetime(2026, 3, 1, 2, 3, 4, 5, tzinfo=timezone(timedelta(hours=-7, minutes=-30))),
    datetime(2001, 2, 3, 4, 5, 6, 700000),
    datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
]


@pytest.mark.parametrize("moment", MOMENTS, ids=str)
def test_a_time_converts_as_from_datetime_does(moment: datetime) -> None:
    expected = Timestamp()
    expected.FromDatetime(moment)
    assert _timestamp(moment) == expected
