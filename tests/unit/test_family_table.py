"""docs/production.md's family table names every hybrid architecture of the
committed list (maintainers/data/hybrid-families.json, read from vLLM's model
registry by ``python -m maintainers.families write``) exactly once, and no
other: a family vLLM adds gets a row or this fails."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "production.md"


def table_rows() -> list[str]:
    text = PAGE.read_text()
    begin, end = (
        text.index("<!-- families:begin -->"),
        text.index("<!-- families:end -->"),
    )
    return [line for line in text[begin:end].splitlines() if line.startswith("| `")]


def named_architectures() -> Counter[str]:
    """The architectures of the table's first column (each in backquotes)."""
    return Counter(
        name
        for row in table_rows()
        for name in re.findall(r"`([^`]+)`", row.split(" | ")[0])
    )


def test_the_table_names_each_committed_family_once() -> None:
    from maintainers import families

    record = families.committed()
    listed = set(record["architectures"])  # type: ignore[arg-type]
    named = named_architectures()
    assert set(named) == listed, (
        f"missing rows: {sorted(listed - set(named))}; "
        f"not hybrid in vLLM {record['release']}: {sorted(set(named) - listed)}"
    )
    assert [a for a, n in named.items() if n > 1] == []


def test_every_row_says_what_the_plugin_does_and_cites_code() -> None:
    for row in table_rows():
        cells = row.strip("|").split(" | ")
        assert len(cells) == 5, row
        assert re.match(
            r"\s*(fixes|stands aside|refuses|two Mamba groups)", cells[4]
        ), row
        assert re.search(r"\.py:\d+", cells[1]), f"no source line for the spec: {row}"
        if cells[4].lstrip().startswith("fixes"):
            cited = re.findall(r"`([^`]+)`", cells[4].split(")")[0])
            assert cited, f"a fix without the test shape backing it: {row}"
            assert set(cited) <= shapes_the_suite_runs(), row


def shapes_the_suite_runs() -> set[str]:
    """The shapes tests/test_families.py runs (each ``Shape("name", …``)."""
    text = (REPO / "tests" / "test_families.py").read_text()
    return set(re.findall(r'Shape\(\s*"([^"]+)"', text))
