"""Time: an injectable clock, and the conversions the store needs.

The store keeps timestamps as integer microseconds since the Unix epoch (UTC):
exact, sortable, and the same on every backend.

Owns: the Clock type, the wall clock, and the conversions between datetimes,
microseconds and the timestamp texts older stores and cagent wrote.
Must not touch: any other sidecar module, the database, configuration; pure
functions, system_clock aside.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime

Clock = Callable[[], datetime]


def system_clock() -> datetime:
    return datetime.now(UTC)


def to_micros(moment: datetime) -> int:
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    delta = moment - datetime(1970, 1, 1, tzinfo=UTC)
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def from_micros(micros: int) -> datetime:
    seconds, rest = divmod(micros, 1_000_000)
    return datetime.fromtimestamp(seconds, UTC).replace(microsecond=rest)


def parse_timestamp(text: str | None) -> datetime | None:
    """Parse the timestamp formats older stores wrote, or return None.

    Accepts RFC 3339 (Go's time.RFC3339 and RFC3339Nano, as cagent writes),
    SQLite's "YYYY-MM-DD HH:MM:SS[.fff]", and Go's default time.Time.String()
    ("2006-01-02 15:04:05.999999999 -0700 MST"). Naive times are taken as UTC.
    """
    if not text:
        return None
    text = text.strip()
    # Go's String() form: drop the monotonic-clock suffix and the zone name.
    text = text.split(" m=")[0]
    parts = text.split(" ")
    if (len(parts) == 4 and parts[2][:1] in "+-") or (len(parts) == 3 and parts[2][:1] in "+-"):
        text = f"{parts[0]}T{parts[1]}{parts[2]}"
    text = text.replace("Z", "+00:00").replace("z", "+00:00")
    # Python 3.11 parses at most 6 fractional digits; Go writes up to 9.
    date_part, sep, frac = text.partition(".")
    if sep:
        digits = ""
        for i, ch in enumerate(frac):
            if not ch.isdigit():
                digits, tail = frac[:i], frac[i:]
                break
        else:
            digits, tail = frac, ""
        text = f"{date_part}.{digits[:6].ljust(6, '0')}{tail}"
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.astimezone(UTC)
