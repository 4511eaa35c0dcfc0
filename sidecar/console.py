"""Terminal output for the operator commands: tables, JSON, progress."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Sequence
from typing import Any, TextIO


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], out: TextIO) -> None:
    """Aligned columns; the last column is cut to fit the terminal."""
    cells = [[str(c).replace("\n", " ⏎ ") for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
    width = shutil.get_terminal_size((120, 24)).columns
    fixed = sum(widths[:-1]) + 2 * (len(widths) - 1)
    widths[-1] = max(len(headers[-1]), min(widths[-1], width - fixed))

    def line(values: Sequence[str]) -> str:
        parts = [v.ljust(w) for v, w in zip(values[:-1], widths, strict=False)]
        last = values[-1]
        if len(last) > widths[-1]:
            last = last[: max(widths[-1] - 1, 0)] + "…"
        return "  ".join([*parts, last]).rstrip()

    print(line(headers), file=out)
    print("  ".join("─" * w for w in widths), file=out)
    for row in cells:
        print(line(row), file=out)


def emit_json(value: Any, out: TextIO) -> None:
    print(json.dumps(value, ensure_ascii=False, indent=2), file=out)


class Progress:
    """A one-line progress report, shown only when stderr is a terminal."""

    def __init__(self, label: str, stream: TextIO | None = None) -> None:
        self._label = label
        self._stream = stream or sys.stderr
        self._shown = self._stream.isatty()
        self._last = ""

    def update(self, done: int, total: int | None = None) -> None:
        if not self._shown:
            return
        text = (
            f"{self._label}: {done:,}/{total:,} ({done * 100 // total}%)"
            if total
            else f"{self._label}: {done:,}"
        )
        if text != self._last:
            self._stream.write("\r" + text)
            self._stream.flush()
            self._last = text

    def done(self) -> None:
        if self._shown and self._last:
            self._stream.write("\n")
            self._stream.flush()
