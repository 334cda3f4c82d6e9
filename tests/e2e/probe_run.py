"""``vllm-mamba-align probe`` run as an operator runs it: the installed
command, in its own process, against a server's address, with ``--json``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

PROBE_TIMEOUT = 600.0  # seconds for the whole probe (47 requests on 2 cores)


@dataclass
class ProbeRun:
    exit_code: int
    report: dict[str, Any]
    stderr: str
    seconds: float

    def cases(self) -> dict[str, dict[str, Any]]:
        return {case["name"]: case for case in self.report["cases"]}

    def diverged(self) -> list[str]:
        return [
            name for name, case in self.cases().items() if case["verdict"] == "DIVERGED"
        ]


def run_probe(url: str, *arguments: str) -> ProbeRun:
    started = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm_mamba_align",
            "probe",
            "--url",
            url,
            "--json",
            *arguments,
        ],
        capture_output=True,
        text=True,
        timeout=PROBE_TIMEOUT,
        stdin=subprocess.DEVNULL,
        # `-m` would put the working directory (the checkout) first on sys.path.
        env={**os.environ, "PYTHONSAFEPATH": "1"},
    )
    try:
        report = json.loads(done.stdout)
    except ValueError:
        raise AssertionError(
            f"probe exited {done.returncode} without a JSON report:\n"
            f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        ) from None
    return ProbeRun(done.returncode, report, done.stderr, time.monotonic() - started)
