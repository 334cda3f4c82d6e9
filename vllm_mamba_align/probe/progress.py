"""Progress of a probe on the terminal: one line on stderr, rewritten in place,
only when stderr is a terminal (never in logs, pipes or CI)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from .run import Progress


@contextlib.contextmanager
def terminal_progress() -> Iterator[Progress | None]:
    stream = sys.stderr
    if not stream.isatty():
        yield None
        return
    shown = [0]

    def show(done: int, total: int, what: str) -> None:
        line = f"probe: {done}/{total} requests, {what}"
        stream.write("\r" + line.ljust(shown[0]))
        stream.flush()
        shown[0] = len(line)

    try:
        yield show
    finally:
        if shown[0]:
            stream.write("\r" + " " * shown[0] + "\r")
            stream.flush()
