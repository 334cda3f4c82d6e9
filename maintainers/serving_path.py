"""The serving path's size: the package modules a lean scheduler's process
loads, the modules ``register()`` reaches, and their lines of code.

Two measures, one count of code lines:

- **loaded** (``--loaded``, needs vLLM in this Python): the package modules in
  ``sys.modules`` of a fresh process after ``register()`` and the start of a
  real lean scheduler (vLLM's ``Scheduler`` built as its engine core builds it,
  tools.sim's tiny hybrid model on CPU). The scheduler's inputs are built first
  with the plugin not loaded (``VLLM_PLUGINS`` names every other installed
  plugin); then every package module the tools imported leaves
  ``sys.modules``, the package is imported afresh, ``register()`` runs and
  vLLM's ``Scheduler`` is built from the same inputs: what is loaded then is
  what the plugin loads, and nothing of the tools'. This is the measure of
  what serving costs.
- **reached** (always): the modules an ``import`` or ``from ... import`` of
  ``vllm_mamba_align`` names, at module level or inside a function, starting
  from the package's ``__init__`` (the entry point's module); what only the
  tools, the probe, ``doctor`` or the CLI import is not reached. An upper
  bound: it counts what a refusal, the audit or a drafter's hazard would load.

``python -m maintainers.serving_path`` prints one row per module (lines, code
lines) and the total; ``--loaded`` prints the loaded modules and both totals;
``--json`` for a record. Code lines are lines with a token that is neither a
comment nor part of a bare string statement (docstrings and attribute
docstrings), so moving code out shrinks the count and rewrapping prose does not.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import os
import subprocess
import sys
import textwrap
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


LEAN_START = textwrap.dedent(
    """
    import json
    import os
    import sys
    from importlib import metadata

    # The inputs of a real scheduler, built by the tools with the plugin not
    # loaded: vLLM loads every installed plugin VLLM_PLUGINS names (all when
    # it is unset) while it builds the config.
    named = os.environ.get("VLLM_PLUGINS")
    installed = {
        entry.name
        for group in ("vllm.general_plugins", "vllm.platform_plugins")
        for entry in metadata.entry_points(group=group)
    }
    others = installed if named is None else set(named.split(","))
    os.environ["VLLM_PLUGINS"] = ",".join(sorted(others - {"mamba_align"}))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the tiny model is local
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

    import vllm.v1.core.sched.scheduler as scheduler_module
    from vllm_mamba_align.tools.sim import Geometry, build_scheduler

    inputs = {}
    vllms_init = scheduler_module.Scheduler.__init__

    def keep_inputs(self, *args, **kwargs):
        inputs.update(kwargs)
        vllms_init(self, *args, **kwargs)

    scheduler_module.Scheduler.__init__ = keep_inputs
    build_scheduler(Geometry(cache_block=1648, state_block=1648)).shutdown()
    scheduler_module.Scheduler.__init__ = vllms_init

    # Forget the package modules the tools imported; from here on only the
    # plugin and vLLM run.
    def package_modules():
        return sorted(n for n in sys.modules if n.split(".")[0] == "vllm_mamba_align")

    for name in package_modules():
        del sys.modules[name]
    import vllm_mamba_align

    vllm_mamba_align.register()
    scheduler = scheduler_module.Scheduler(**inputs)
    record = {
        "fixing": "mamba_state_block_size" in vars(scheduler),
        "modules": package_modules(),
    }
    scheduler.shutdown()
    print("loaded:", json.dumps(record))
    """
)
"""A fresh process's ``register()`` and lean scheduler start; prints ``loaded:``
and a JSON record (``fixing``: the fix bound; ``modules``: the package's)."""


def loaded_record(output: str) -> dict[str, object]:
    """The record :data:`LEAN_START` printed."""
    line = next(line for line in output.splitlines() if line.startswith("loaded: "))
    record: dict[str, object] = json.loads(line.removeprefix("loaded: "))
    return record


def loaded_by_lean_scheduler(python: str = sys.executable) -> list[str]:
    """The package modules a lean scheduler's process loads (run in ``python``,
    which must have vLLM; the package imported from this checkout)."""
    env = {
        **os.environ,
        "VLLM_MAMBA_ALIGN_MODE": "lean",
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(PACKAGE.parent), os.environ.get("PYTHONPATH", "")) if p
        ),
    }
    done = subprocess.run(
        [python, "-c", LEAN_START], env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise SystemExit(f"the lean scheduler did not start:\n{done.stderr}")
    record = loaded_record(done.stdout)
    if not record["fixing"]:
        raise SystemExit(f"the fix is not bound in the lean scheduler:\n{done.stderr}")
    modules = record["modules"]
    assert isinstance(modules, list)
    return [str(name) for name in modules]


def measure(names: list[str] | None = None) -> list[Module]:
    """Lines and code lines of each module ``names`` (default: the reach)."""
    modules = []
    for name in reached_from_register() if names is None else names:
        path = module_path(name)
        assert path is not None, name
        source = path.read_text()
        modules.append(Module(name, len(source.splitlines()), code_lines(source)))
    return modules


def totals(modules: list[Module]) -> dict[str, int]:
    return {
        "modules": len(modules),
        "lines": sum(m.lines for m in modules),
        "code_lines": sum(m.code_lines for m in modules),
    }


def summary(modules: list[Module]) -> str:
    found = totals(modules)
    return (
        f"{found['modules']} modules: {found['lines']:,} lines, "
        f"{found['code_lines']:,} of code"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--loaded",
        action="store_true",
        help="also the modules a lean scheduler's process loads (needs vLLM)",
    )
    arguments = parser.parse_args()
    reached = measure()
    loaded = measure(loaded_by_lean_scheduler()) if arguments.loaded else None
    shown = reached if loaded is None else loaded
    if arguments.json:
        record: dict[str, object] = {
            "modules": [asdict(m) for m in shown],
            **{k: v for k, v in totals(shown).items() if k != "modules"},
        }
        if loaded is not None:
            record["measure"] = "loaded by a lean scheduler"
            record["reached"] = totals(reached)
        print(json.dumps(record, indent=2))
        return
    for module in shown:
        print(f"{module.name:<40} {module.lines:>6} {module.code_lines:>6}")
    if loaded is not None:
        print(f"loaded by a lean scheduler: {summary(loaded)}")
    print(f"reached from register(): {summary(reached)}")


if __name__ == "__main__":
    main()
