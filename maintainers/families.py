"""The hybrid families of a vLLM release, read from its model registry.

docs/production.md's family table has one row per hybrid family of the newest
verified vLLM; which architectures there are is one fact, kept in one place:
``maintainers/data/hybrid-families.json``, written from an installed vLLM by

    python -m maintainers.families write     # in a release's test environment

The registry (``vllm/model_executor/models/registry.py``) maps each
architecture to a module and a class; vLLM calls an architecture hybrid when
its class is an ``IsHybrid`` (``interfaces.is_hybrid``: the class attribute
``is_hybrid`` is true). Importing every model class to ask needs each model's
optional dependencies (torchvision, mistral_common, ...) and the platform's
kernels, so the classes are read from their source instead: a class is hybrid
when it sets ``is_hybrid = True``, names ``IsHybrid`` among its bases, or
inherits from a hybrid class. tests/test_families.py holds this reading to
vLLM's own predicate on every class that imports on CPU, and the committed
list to the installed registry; tests/unit/test_family_table.py holds the
table to the committed list.
"""

from __future__ import annotations

import argparse
import ast
import json
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FAMILIES = REPO / "maintainers" / "data" / "hybrid-families.json"
REGISTRY = Path("model_executor") / "models" / "registry.py"


def registry_entries(vllm_dir: Path) -> dict[str, tuple[str, str]]:
    """Every architecture of the registry's tables: (module, class name).

    A module is as the registry writes it: a bare name under
    ``vllm.model_executor.models``, or a dotted ``vllm.…`` path. The first
    table naming an architecture wins, as in the registry's own merge order.
    """
    tree = ast.parse((vllm_dir / REGISTRY).read_text())
    entries: dict[str, tuple[str, str]] = {}
    for node in tree.body:
        if not isinstance(node, ast.Assign | ast.AnnAssign):
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        names = [t.id for t in targets if isinstance(t, ast.Name)]
        if not any(n.startswith("_") and n.endswith("_MODELS") for n in names):
            continue
        if not isinstance(node.value, ast.Dict):
            continue
        for key, value in zip(node.value.keys, node.value.values, strict=True):
            if not isinstance(key, ast.Constant) or not isinstance(value, ast.Tuple):
                continue
            parts = [e.value for e in value.elts if isinstance(e, ast.Constant)]
            if len(parts) == 2 and all(isinstance(p, str) for p in parts):
                entries.setdefault(str(key.value), (str(parts[0]), str(parts[1])))
    return entries


def _module_path(vllm_dir: Path, dotted: str) -> Path | None:
    """The source file of a dotted module inside the vLLM tree (a package:
    its ``__init__.py``); None outside it."""
    parts = dotted.split(".")
    if parts[0] != "vllm":
        return None
    path = vllm_dir.parent.joinpath(*parts)
    if path.is_dir():
        return path / "__init__.py"
    file = path.with_suffix(".py")
    return file if file.exists() else None


def _base_name(base: ast.expr) -> str | None:
    if isinstance(base, ast.Subscript):
        base = base.value
    if isinstance(base, ast.Name):
        return base.id
    if isinstance(base, ast.Attribute):
        return base.attr
    return None


def _sets_hybrid(node: ast.ClassDef) -> bool | None:
    """The class body's own ``is_hybrid = …`` (None when it sets none)."""
    for statement in node.body:
        target: ast.expr | None = None
        if isinstance(statement, ast.Assign) and len(statement.targets) == 1:
            target = statement.targets[0]
        elif isinstance(statement, ast.AnnAssign):
            target = statement.target
        value = getattr(statement, "value", None)
        if (
            isinstance(target, ast.Name)
            and target.id == "is_hybrid"
            and isinstance(value, ast.Constant)
        ):
            return bool(value.value)
    return None


def _module_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """A module's statements, those under ``if``/``try``/``with`` included
    (a package picks its platform's implementation that way); function and
    class bodies are not entered."""
    for node in body:
        yield node
        if isinstance(node, ast.If | ast.With):
            yield from _module_level(node.body)
            yield from _module_level(getattr(node, "orelse", []))
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody):
                yield from _module_level(block)
            for handler in node.handlers:
                yield from _module_level(handler.body)


class _Module:
    """One source file: its classes and where each imported name comes from
    (every ``from … import`` of the file, those under ``if`` included: a
    package picks its platform's implementation that way)."""

    def __init__(self, path: Path, dotted: str) -> None:
        tree = ast.parse(path.read_text())
        package = dotted if path.name == "__init__.py" else dotted.rpartition(".")[0]
        self.classes: dict[str, list[ast.ClassDef]] = {}
        self.imports: dict[str, list[tuple[str, str]]] = {}
        for node in _module_level(tree.body):
            if isinstance(node, ast.ClassDef):
                self.classes.setdefault(node.name, []).append(node)
            elif isinstance(node, ast.ImportFrom):
                source = node.module or ""
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    source = ".".join([*base, source] if source else base)
                for alias in node.names:
                    self.imports.setdefault(alias.asname or alias.name, []).append(
                        (source, alias.name)
                    )


class _Reader:
    """Follows class bases through the imports of vLLM's own files."""

    def __init__(self, vllm_dir: Path) -> None:
        self.vllm_dir = vllm_dir
        self._modules: dict[str, _Module | None] = {}
        self._known: dict[tuple[str, str], bool] = {}

    def module(self, dotted: str) -> _Module | None:
        if dotted not in self._modules:
            path = _module_path(self.vllm_dir, dotted)
            self._modules[dotted] = None if path is None else _Module(path, dotted)
        return self._modules[dotted]

    def hybrid(self, dotted: str, name: str) -> bool:
        """Whether ``name`` as ``dotted`` defines or imports it is hybrid."""
        key = (dotted, name)
        if key in self._known:
            return self._known[key]
        self._known[key] = False  # a cycle reads as not hybrid
        module = self.module(dotted)
        answer = False
        if module is not None:
            answer = any(
                self._class_hybrid(dotted, c) for c in module.classes.get(name, [])
            )
            if not answer and name not in module.classes:
                answer = any(
                    self.hybrid(source, original)
                    for source, original in module.imports.get(name, [])
                )
        self._known[key] = answer
        return answer

    def _class_hybrid(self, dotted: str, node: ast.ClassDef) -> bool:
        own = _sets_hybrid(node)
        if own is not None:
            return own
        for base in node.bases:
            name = _base_name(base)
            if name == "IsHybrid":
                return True
            if name is not None and self.hybrid(dotted, name):
                return True
        return False


def hybrid_architectures(vllm_dir: Path) -> dict[str, str]:
    """The registry's hybrid architectures: name -> ``module:Class``."""
    reader = _Reader(vllm_dir)
    return {
        arch: f"{module}:{name}"
        for arch, (module, name) in sorted(registry_entries(vllm_dir).items())
        if reader.hybrid(_dotted(module), name)
    }


def _dotted(module: str) -> str:
    """A registry module as a dotted path."""
    if module.startswith("vllm."):
        return module
    return f"vllm.model_executor.models.{module}"


def committed() -> dict[str, object]:
    """The committed list: ``{"release": …, "architectures": {name: module:Class}}``."""
    return json.loads(FAMILIES.read_text())  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("write", help="write the list from the installed vLLM")
    sub.add_parser("show", help="print the installed vLLM's hybrid architectures")
    args = parser.parse_args()
    import vllm

    from vllm_mamba_align.releases import installed_version

    found = hybrid_architectures(Path(vllm.__file__).parent)
    if args.command == "show":
        for arch, where in found.items():
            print(f"{arch}\t{where}")
        return
    FAMILIES.parent.mkdir(exist_ok=True)
    record = {"release": installed_version(), "architectures": found}
    FAMILIES.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {len(found)} architectures to {FAMILIES.relative_to(REPO)}")


if __name__ == "__main__":
    main()
