"""What a package index shows: a description whose links work there, and who
makes the package."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def project() -> dict[str, object]:
    tomllib = pytest.importorskip("tomllib")
    table = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert isinstance(table, dict)
    return table


def test_the_package_description_has_no_relative_links() -> None:
    """A package index shows the description away from the repository: a link
    to docs/… or CHANGELOG.md leads nowhere there (README.md has such links)."""
    text = (REPO / str(project()["readme"])).read_text()
    targets = re.findall(r"\]\(([^)\s]+)", text) + re.findall(r'href="([^"]+)"', text)
    relative = [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*://", t)]
    assert relative == []


def test_the_link_check_sees_the_readmes_relative_links() -> None:
    """The control: the same reading finds README.md's links into docs/."""
    text = (REPO / "README.md").read_text()
    assert "docs/index.md" in re.findall(r"\]\(([^)\s]+)", text)


def test_the_package_names_its_authors_and_maintainers() -> None:
    table = project()
    for role in ("authors", "maintainers"):
        people = table.get(role)
        assert isinstance(people, list) and people, role
        assert all(isinstance(p, dict) and p.get("name") for p in people), role
