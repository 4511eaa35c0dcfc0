"""The change feed's base: a feed that keeps failing retries for ever, with a
capped back-off, and says so once per outage (not once a cycle)."""

from __future__ import annotations

import logging

import pytest

from sidecar.storage.changes import BACKOFF_CAP_SECONDS, ChangeFeed


class Flaky(ChangeFeed):
    """Fails to connect while `down`; delivers nothing."""

    polls = False

    def __init__(self) -> None:
        super().__init__(
            lambda *change: None, interval=1.0, stale_after=3.0, publish=lambda payload: None
        )
        self.down = True
        self.open = False

    def _open(self) -> bool:
        if self.open:
            return False
        if self.down:
            raise OSError("remaining connection slots are reserved")
        self.open = True
        self.connects += 1
        return True

    def _cycle(self) -> bool:
        return True

    def _close(self) -> None:
        self.open = False


def test_a_failing_feed_backs_off_to_a_cap_and_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    feed = Flaky()
    waits: list[float] = []
    with caplog.at_level(logging.INFO, logger="sidecar.changes"):
        for _ in range(8):
            feed.run_once()
            waits.append(feed.retry_seconds)
        assert waits == [1.0, 2.0, 4.0] + [BACKOFF_CAP_SECONDS] * 5
        assert not feed.verified
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]

        feed.down = False
        feed.run_once()
    assert feed.verified
    assert feed.connects == 1
    assert feed.retry_seconds == feed.interval
    assert "back after 8 failed attempts" in caplog.text
