"""The decision table (``activation.DECISION``) that ``attach`` walks and
``doctor`` reads: doctor has words for every row and no row of its own, ``off``
comes before every row that refuses or binds, and every row has a real-vLLM test
that reaches it (named through ``tests/decision_rows.row``)."""

from __future__ import annotations

import ast
from pathlib import Path

from vllm_mamba_align import activation, doctor
from vllm_mamba_align.activation import DECISION, Facts, Outcome
from vllm_mamba_align.recognition import Recognition
from vllm_mamba_align.settings import Mode

TESTS = Path(__file__).resolve().parents[1]
KEYS = [row.key for row in DECISION]


def test_each_row_has_one_key() -> None:
    assert len(set(KEYS)) == len(KEYS)


def test_doctor_has_words_for_every_row_and_for_no_other() -> None:
    """doctor's account is the table's: a row without words would print
    nothing for it (a KeyError in ``collect``), words without a row are a
    second copy of a decision."""
    assert list(doctor.ROW_WORDS) == KEYS


def test_doctor_words_a_start_only_where_the_row_starts_the_scheduler() -> None:
    """A refusing row's verdict is its error; every other row's is how a
    hybrid model then starts."""
    for row in DECISION:
        starts = doctor.ROW_WORDS[row.key].starts
        assert (starts is None) is (row.outcome is Outcome.REFUSE), row.key


def test_off_comes_before_every_row_that_refuses_or_binds() -> None:
    """Mode off changes nothing whatever the rows below it would find."""
    off = KEYS.index("off")
    changing = [row.key for row in DECISION if row.outcome is not Outcome.STAND_ASIDE]
    assert changing
    assert all(KEYS.index(key) > off for key in changing), KEYS


def test_the_last_row_decides_what_no_row_above_did() -> None:
    facts = Facts(Mode.LEAN, Recognition(None, None, None, verified=False), object)
    assert DECISION[-1].holds(facts) is True
    assert DECISION[-1].outcome is Outcome.BIND


def test_the_rows_that_read_a_scheduler_are_decided_at_start_for_doctor() -> None:
    """Without a scheduler (doctor's facts) a condition that reads one answers
    None: it never reads an attribute of a scheduler that is not there."""
    facts = Facts(Mode.OFF, Recognition(None, None, None, verified=False), object)
    walked = activation.rows_walked(facts)
    assert [row.key for row, _ in walked] == KEYS[: KEYS.index("off") + 1]
    held = {row.key: holds for row, holds in walked}
    assert held["no_align_split"] is None and held["no_mamba_spec"] is None
    assert held["upstream_fix"] is False and held["off"] is True


def _rows_named_by_tests() -> set[str]:
    named = set()
    for path in sorted(TESTS.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "row"
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                named.add(node.args[0].value)
    return named


def test_every_row_has_a_real_vllm_test() -> None:
    """A row added to the table without a test that reaches it fails here."""
    assert set(KEYS) - _rows_named_by_tests() == set()
