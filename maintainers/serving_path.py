"""The serving path's size: the package modules ``register()`` reaches, and
their lines of code.

``python -m maintainers.serving_path`` prints one row per module (lines, code
lines) and the total; ``--json`` for a record. A module is reached when an
``import`` or ``from ... import`` of ``vllm_mamba_align`` names it, at module
level or inside a function, starting from the package's ``__init__`` (the entry
point's module); what only the tools, the probe, ``doctor`` or the CLI import
is not reached. Code lines are lines with a token that is neither a comment nor
part of a bare string statement (docstrings and attribute docstrings), so
moving code out shrinks the count and rewrapping prose does not.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import tokenize
from dataclasses import asdict, dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "vllm_mamba_align"
ROOT = "vllm_mamba_align"
PROSE = {
    tokenize.COMMENT,
    tokenize.NL,
    tokenize.NEWLINE,
    tokenize.INDENT,
    tokenize.DEDENT,
    tokenize.ENCODING,
    tokenize.ENDMARKER,
}


@dataclass(frozen=True)
class Module:
    name: str
    lines: int
    code_lines: int


def module_path(name: str) -> Path | None:
    """The file of package module ``name``, or None if it is not one."""
    parts = name.split(".")[1:]
    if not parts:
        return PACKAGE / "__init__.py"
    relative = Path(*parts)
    for candidate in (
        PACKAGE / relative / "__init__.py",
        PACKAGE / relative.with_suffix(".py"),
    ):
        if candidate.is_file():
            return candidate
    return None


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> set[str]:
    """Package modules ``path`` imports anywhere (relative imports resolved)."""
    own = _module_name(path)
    package = own if path.name == "__init__.py" else own.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    reached = set()
    for name in found:
        if name.split(".")[0] != ROOT:
            continue
        # a parent package is imported along with any of its modules
        parts = name.split(".")
        for end in range(1, len(parts) + 1):
            if module_path(".".join(parts[:end])) is not None:
                reached.add(".".join(parts[:end]))
    return reached


def reached_from_register() -> list[str]:
    seen: set[str] = set()
    todo = [ROOT]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        path = module_path(name)
        assert path is not None, name
        todo.extend(imported(path) - seen)
    return sorted(seen)


def code_lines(source: str) -> int:
    prose: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
            and node.end_lineno is not None
        ):
            prose.update(range(node.lineno, node.end_lineno + 1))
    code: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in PROSE:
            continue
        for line in range(token.start[0], token.end[0] + 1):
            if line not in prose:
                code.add(line)
    return len(code)


def measure() -> list[Module]:
    modules = []
    for name in reached_from_register():
        path = module_path(name)
        assert path is not None
        source = path.read_text()
        modules.append(Module(name, len(source.splitlines()), code_lines(source)))
    return modules


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    arguments = parser.parse_args()
    modules = measure()
    lines = sum(m.lines for m in modules)
    code = sum(m.code_lines for m in modules)
    if arguments.json:
        record = {
            "modules": [asdict(m) for m in modules],
            "lines": lines,
            "code_lines": code,
        }
        print(json.dumps(record, indent=2))
        return
    for module in modules:
        print(f"{module.name:<40} {module.lines:>6} {module.code_lines:>6}")
    print(f"{len(modules)} modules: {lines:,} lines, {code:,} of code")


if __name__ == "__main__":
    main()
