"""Which row of the plugin's decision table (``activation.DECISION``) decided,
for the row tests: each real-vLLM test that reaches a row names it through
:func:`row`, and tests/unit/test_decision_table.py fails when a row is named by
none."""

from __future__ import annotations

import pytest

from vllm_mamba_align import activation


def row(key: str) -> str:
    """A row's key, checked against the table (a renamed row fails here)."""
    assert key in {each.key for each in activation.DECISION}, key
    return key


class Decisions:
    """The key of the row that decided each scheduler built while installed,
    read where ``attach`` asks the table (``activation.decide``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.keys: list[str] = []
        decide = activation.decide

        def recorded(facts: activation.Facts) -> activation.Row:
            decided = decide(facts)
            self.keys.append(decided.key)
            return decided

        monkeypatch.setattr(activation, "decide", recorded)


PRINT_ROWS = """
import vllm_mamba_align.activation as _activation
_decide = _activation.decide
def _printed(facts):
    decided = _decide(facts)
    print("row:", decided.key, flush=True)
    return decided
_activation.decide = _printed
"""
"""For a child interpreter (helpers.run_python): print ``row: <key>`` for each
scheduler the table decides."""
