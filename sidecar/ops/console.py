"""Terminal output for the operator commands: tables, JSON, progress.

sidecar.ops.admin prints through it: aligned tables whose last column wraps to the
terminal (widths counted in display columns: CJK and emoji take two), indented
JSON, and a one-line progress report redrawn at most ten times a second.

Owns: how output looks on a terminal and in a pipe (nothing is cut or wrapped
there). Must not touch: any other sidecar module, the daemon, the database; it
writes only to the streams it is given (Progress: stderr, and only on a tty).
"""

from __future__ import annotations

import json
import shutil
import sys
import time
import unicodedata
from collections.abc import Sequence
from typing import Any, TextIO


def width(text: str) -> int:
    """Columns a text takes in a terminal: wide (CJK, emoji) characters two,
    combining marks none."""
    return sum(
        0
        if unicodedata.combining(ch)
        else 2
        if unicodedata.east_asian_width(ch) in ("W", "F")
        else 1
        for ch in text
    )


def _wrap(text: str, columns: int) -> list[str]:
    """The text in pieces of at most `columns` terminal columns."""
    pieces, current, used = [], "", 0
    for ch in text:
        w = width(ch)
        if used + w > columns and current:
            pieces.append(current)
            current, used = "", 0
        current += ch
        used += w
    pieces.append(current)
    return pieces


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], out: TextIO) -> None:
    """Aligned columns. On a terminal the last column wraps to fit it;
    into a pipe or a file nothing is cut or wrapped."""
    cells = [[str(c).replace("\n", " ⏎ ") for c in row] for row in rows]
    widths = [width(h) for h in headers]
    for row in cells:
        widths = [max(w, width(c)) for w, c in zip(widths, row, strict=True)]
    fixed = sum(widths[:-1]) + 2 * (len(widths) - 1)
    last: int | None = None  # no limit
    if out.isatty():
        columns = shutil.get_terminal_size((120, 24)).columns
        last = max(width(headers[-1]), 20, columns - fixed)

    def pad(value: str, w: int) -> str:
        return value + " " * (w - width(value))

    def lines(values: Sequence[str]) -> list[str]:
        head = "  ".join(pad(v, w) for v, w in zip(values[:-1], widths, strict=False))
        pieces = _wrap(values[-1], last) if last else [values[-1]]
        indent = " " * (fixed if len(values) > 1 else 0)
        joiner = "  " if len(values) > 1 else ""
        return [(head + joiner + pieces[0]).rstrip()] + [
            (indent + piece).rstrip() for piece in pieces[1:]
        ]

    for line in lines(headers):
        print(line, file=out)
    rule = [*widths[:-1], min(widths[-1], last or widths[-1])]
    print("  ".join("─" * w for w in rule), file=out)
    for row in cells:
        for line in lines(row):
            print(line, file=out)


def emit_json(value: Any, out: TextIO) -> None:
    print(json.dumps(value, ensure_ascii=False, indent=2), file=out)


class Progress:
    """A one-line progress report, shown only when stderr is a terminal."""

    def __init__(self, label: str, stream: TextIO | None = None) -> None:
        self._label = label
        self._stream = stream or sys.stderr
        self._shown = self._stream.isatty()
        self._last = ""
        self._drawn = float("-inf")

    def update(self, done: int, total: int | None = None) -> None:
        if not self._shown:
            return
        text = (
            f"{self._label}: {done:,}/{total:,} ({done * 100 // total}%)"
            if total
            else f"{self._label}: {done:,}"
        )
        now = time.monotonic()
        # At most ten redraws a second: a tight loop must not spend its time
        # writing to the terminal.
        if text != self._last and (now - self._drawn >= 0.1 or (total and done >= total)):
            self._stream.write("\r" + text)
            self._stream.flush()
            self._last, self._drawn = text, now

    def done(self) -> None:
        if self._shown and self._last:
            self._stream.write("\n")
            self._stream.flush()
