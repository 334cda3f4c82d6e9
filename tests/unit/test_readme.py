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


def test_every_mode_names_where_it_is_the_best_choice() -> None:
    """A mode ships only with a measured row in docs/modes.md saying where it is
    the one to run; a mode added without one (or a row for a mode that no longer
    exists) fails here."""
    from vllm_mamba_align.settings import Mode

    page = (REPO / "docs" / "modes.md").read_text()
    section = page.split("## Where each mode is the best choice", 1)[1]
    section = section.split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| (.+?) \| (.+?) \|$", section, re.MULTILINE)
    assert sorted(name for name, _, _ in rows) == sorted(m.value for m in Mode)
    for name, _, measured in rows:
        assert re.search(r"\d", measured), f"{name}: no measured figure"
