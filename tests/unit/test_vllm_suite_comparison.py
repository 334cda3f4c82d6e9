"""maintainers/vllm_suite.py's judgement of vLLM's own tests (`nox -s vllm_suite`): an
outcome the plugin changes fails the run unless the exceptions table names the
test; failures shared by stock and every mode are the environment's."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

import pytest


@pytest.fixture
def suite() -> ModuleType:
    return importlib.import_module("maintainers.vllm_suite")


def junit(folder: Path, mode: str, cases: dict[str, str]) -> str:
    """A junit XML file as pytest writes it: test name -> passed, failed,
    error or skipped, in module ``tests.v1.core.test_x``."""
    body = {
        "passed": "",
        "failed": '<failure message="assert 3 == 4">trace</failure>',
        "error": '<error message="fixture missing">trace</error>',
        "skipped": '<skipped message="no GPU" />',
    }
    rows = "".join(
        f'<testcase classname="tests.v1.core.test_x" name="{name}">{body[status]}'
        "</testcase>"
        for name, status in cases.items()
    )
    path = folder / f"{mode}.xml"
    path.write_text(f"<testsuites><testsuite>{rows}</testsuite></testsuites>")
    return f"{mode}={path}"


STOCK = {"a": "passed", "b": "passed", "env": "error", "gpu": "skipped"}


def test_identical_runs_pass_and_shared_failures_are_reported_not_counted(
    suite: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = [junit(tmp_path, mode, STOCK) for mode in ("stock", "kept", "full")]
    assert suite.main(["compare", *runs]) == 0
    shown = capsys.readouterr().out
    assert "1 tests fail in stock and every mode alike" in shown
    assert "fixture missing" in shown
    assert "0 outcomes changed" in shown


def test_a_changed_outcome_fails_the_run_and_names_the_test_and_message(
    suite: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kept = {**STOCK, "b": "failed"}
    grid = {key: status for key, status in STOCK.items() if key != "a"}
    runs = [
        junit(tmp_path, "stock", STOCK),
        junit(tmp_path, "kept", kept),
        junit(tmp_path, "grid", grid),
    ]
    assert suite.main(["compare", *runs]) == 1
    shown = capsys.readouterr().out
    assert "changed in kept: tests.v1.core.test_x::b: passed -> failed" in shown
    assert "assert 3 == 4" in shown
    assert "changed in grid: tests.v1.core.test_x::a: passed -> missing" in shown
    assert "2 outcomes changed" in shown


def test_a_change_the_exceptions_table_names_is_reported_not_counted(
    suite: ModuleType, tmp_path: Path
) -> None:
    stock = suite.read_junit(Path(junit(tmp_path, "stock", STOCK).split("=")[1]))
    kept = suite.read_junit(
        Path(junit(tmp_path, "kept", {**STOCK, "b": "failed"}).split("=")[1])
    )
    why = {"tests.v1.core.test_x::b": "asserts stock's chunk ends"}
    verdict = suite.compare({"stock": stock, "kept": kept}, why)
    assert verdict.changed == 0
    assert list(verdict.results[1].excepted) == ["tests.v1.core.test_x::b"]
    assert "why excepted: asserts stock's chunk ends" in suite.report(verdict, why)
    counts = verdict.results[1]
    assert (counts.passed, counts.failed, counts.skipped) == (1, 2, 1)
