"""The README a user reads in five minutes: short, with the commands CI runs."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"


def test_the_readme_is_at_most_250_lines() -> None:
    assert len(README.read_text().splitlines()) <= 250


def test_the_readme_gives_the_command_ci_runs() -> None:
    """`.ci/run` runs exactly the README's test command."""
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    command = next(line for line in ci if "nox" in line and not line.startswith("#"))
    assert command.strip() in README.read_text()


def test_the_readme_gives_the_demo_command() -> None:
    assert "python3 -m pip install -q nox && python3 -m nox -s demo" in (
        README.read_text()
    )


def test_readme_docs_and_changelog_describe_the_software_not_its_history() -> None:
    history = re.compile(
        r"this session|session \d|earlier run|previous run|\brun \d+\b|"
        r"\bfirst runs?\b of the suite|before .* existed",
        re.IGNORECASE,
    )
    pages = [README, REPO / "CHANGELOG.md", *sorted((REPO / "docs").rglob("*.md"))]
    found = [
        f"{page.relative_to(REPO)}:{number}: {line.strip()}"
        for page in pages
        for number, line in enumerate(page.read_text().splitlines(), 1)
        if history.search(line)
    ]
    assert not found, "\n".join(found)


def test_readme_links_into_docs_resolve() -> None:
    text = README.read_text()
    links = re.findall(r"\]\(((?:docs/|CHANGELOG)[^)#]*)", text)
    assert links, "the README links into the manual"
    missing = [link for link in links if not (REPO / link).exists()]
    assert not missing, missing
