"""The report a maintainer reads: one section per step, the draft entry last.

Printed as it grows and written to ``.nox/onboard-<release>/report.md``;
a failed check is listed, and the exit status follows from the list.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field

from maintainers import drafting


@dataclass
class Report:
    release: str
    sections: list[tuple[str, str]] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)

    def add(self, title: str, text: str) -> None:
        self.sections.append((title, text.rstrip()))
        print(f"\n## {title}\n\n{text.rstrip()}", flush=True)

    def fail(self, problem: str) -> None:
        self.failed.append(problem)

    def markdown(self) -> str:
        parts = [f"# Onboarding vLLM {self.release}"]
        parts += [f"## {title}\n\n{text}" for title, text in self.sections]
        return "\n\n".join(parts) + "\n"


def fence(text: str, kind: str = "") -> str:
    return f"```{kind}\n{text.rstrip()}\n```"


def site_diffs(
    old: drafting.ReleaseCode, new: drafting.ReleaseCode, draft: drafting.Draft
) -> str:
    parts = []
    old_shape = drafting.split_shape(old)
    if old_shape is not None:
        added, removed = drafting.names_changed(old_shape, draft.shape)
        parts.append(
            f"Names the split uses that {old.version}'s does not: "
            f"{', '.join(added) or 'none'}; no longer used: "
            f"{', '.join(removed) or 'none'}."
        )
    for site in drafting.SITES:
        verdict, diff = drafting.site_diff(old, new, site)
        line = f"- {site.name} (`{site.file}`: {site.why}): {verdict}"
        parts.append(line + (f"\n\n{fence(diff, 'diff')}\n" if diff else ""))
    return "\n".join(parts)


def settings_read(code: drafting.ReleaseCode) -> str:
    lines = []
    for name in ("retention setting", "retention in the KV config"):
        text = drafting.field_text(code, name)
        lines.append(f"- {name}: `{text}`" if text else f"- {name}: absent")
        factory = re.search(r"default_factory=(\w+)", text or "")
        site = next(s for s in drafting.SITES if s.name == name)
        if factory and site.file in code.texts:
            node = drafting.find_definition(
                ast.parse(code.texts[site.file]), factory.group(1)
            )
            if node is not None:
                lines.append(
                    f"  its default:\n\n{fence(drafting.normalized_source(node))}\n"
                )
    for name in ("checkpoint position", "checkpoint validity"):
        site = next(s for s in drafting.SITES if s.name == name)
        node = code.definition(site)
        if isinstance(node, ast.FunctionDef):
            signature = ast.unparse(node.args)
            lines.append(f"- {name}: `{node.name}({signature})`")
        else:
            lines.append(f"- {name}: absent")
    grid, why = drafting.checkpoint_grid(code)
    lines.append(f"- backend checkpoint grid: {grid.name if grid else 'none'} ({why})")
    return "\n".join(lines)
