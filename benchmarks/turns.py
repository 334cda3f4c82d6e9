"""Servers that take turns: while one arm's server is measured, every other
arm's server is stopped (SIGSTOP to its process group) and costs the machine
nothing but memory.

Why: an idle vLLM server is not idle. Its worker polls, about 6 % of a CPU, and
with six servers side by side on 2 cores the 1-minute load average stayed at
1.5-4 with nothing else running, so a run that waits for a load of 1 waited out
its bound almost every time, and each measured arm shared the cores with five
pollers. A stopped process is neither runnable nor counted in the load average.

A stopped server handles no signal but SIGKILL and SIGCONT: everything is
resumed before the servers are stopped (SIGINT), on every way out.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator, Mapping


def _signal(group: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # a group that is gone
        os.killpg(group, signum)


class Turns:
    """The process groups of the arms' servers, by arm name; one runs at a time.

    Use as a context manager: entering pauses every group, leaving resumes every
    group; :meth:`turn` resumes one group for the block it guards.
    """

    def __init__(self, groups: Mapping[str, int]) -> None:
        self.groups = dict(groups)

    def __enter__(self) -> Turns:
        try:
            for group in self.groups.values():
                _signal(group, signal.SIGSTOP)
        except BaseException:
            self.resume_all()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.resume_all()

    def resume_all(self) -> None:
        for group in self.groups.values():
            _signal(group, signal.SIGCONT)

    @contextlib.contextmanager
    def turn(self, name: str) -> Iterator[None]:
        """Resume ``name``'s server for the block; pause it again after."""
        group = self.groups[name]
        _signal(group, signal.SIGCONT)
        try:
            yield
        finally:
            _signal(group, signal.SIGSTOP)
