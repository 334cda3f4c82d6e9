"""The same vLLM code, fingerprinted by every Python vLLM runs on.

vLLM's wheels are abi3: one wheel serves Python 3.10-3.13, and vLLM's official
image runs 3.12. The plugin recognizes a release by fingerprints recorded in
releases.py; they must come out the same on each of those interpreters, or the
plugin refuses to start hybrid models there. This module reads the sites the
plugin fingerprints (the split body and Model Runner V2's worker-seed methods)
from a released wheel or an installed vLLM, has each interpreter fingerprint
them with the plugin's own ``fingerprint.py``, and compares the answers with the
release table.

    python -m maintainers.interpreters vllm-0.33.0-*.whl [...]
    python -m maintainers.interpreters --installed

Each interpreter runs ``fingerprint.py`` alone (loaded by path, standard library
only), so it needs neither vLLM nor the plugin's dependencies installed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from vllm_mamba_align import fingerprint
from vllm_mamba_align.releases import (
    GROUP_INFO_BODIES,
    GROUP_INFO_METHOD,
    MODEL_STATE,
    SEED_METHOD,
    WORKER_FILE,
    expected_body,
    seed_code,
)

SUPPORTED_PYTHONS = ("3.10", "3.11", "3.12", "3.13")
"""The interpreters vLLM's abi3 wheels run on."""
SCHEDULER_FILE = "v1/core/sched/scheduler.py"
SITES: dict[str, tuple[str, str, str]] = {
    "split": (SCHEDULER_FILE, "Scheduler", "_mamba_block_aligned_split"),
    "seed": (WORKER_FILE, MODEL_STATE, SEED_METHOD),
    "group_info": (WORKER_FILE, MODEL_STATE, GROUP_INFO_METHOD),
}
"""Every site the plugin recognizes by fingerprint: (file under vllm/, class,
method)."""

# Runs in each interpreter: fingerprint.py loaded by path, sources on stdin.
_CHILD = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("fingerprint", sys.argv[1])
module = importlib.util.module_from_spec(spec)
sys.modules["fingerprint"] = module
spec.loader.exec_module(module)
answers = {}
for key, (source, class_name, method) in json.load(sys.stdin).items():
    node = module.method_in_source(source, class_name, method)
    answers[key] = None if node is None else module.fingerprint_node(node)
print(json.dumps(answers))
"""


def find_python(version: str) -> str | None:
    """An interpreter for ``version`` ("3.12"): pyenv's own build of it, else
    one on PATH that runs (pyenv's shims are on PATH for every version but run
    only the selected ones)."""
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    for candidate in sorted(root.glob(f"versions/{version}.*/bin/python{version}")):
        return str(candidate)
    found = shutil.which(f"python{version}")
    if found and subprocess.run([found, "-c", ""], capture_output=True).returncode == 0:
        return found
    return None


def read_sites(source: Path) -> tuple[str | None, dict[str, str]]:
    """vLLM's version and the module sources the sites live in, from a wheel
    (``vllm-X-….whl``) or an installed ``vllm`` package directory."""
    files = {path for path, _, _ in SITES.values()}
    texts: dict[str, str] = {}
    if source.is_file():
        match = re.match(r"vllm(?:_cpu)?-([^-]+)-", source.name)
        version = match.group(1) if match else None
        with zipfile.ZipFile(source) as wheel:
            names = set(wheel.namelist())
            for path in files:
                if f"vllm/{path}" in names:
                    texts[path] = wheel.read(f"vllm/{path}").decode("utf-8")
        return version, texts
    version_file = source / "_version.py"  # written by setuptools-scm
    match = re.search(
        r"^__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)",
        version_file.read_text(encoding="utf-8") if version_file.exists() else "",
        re.MULTILINE,
    )
    for path in files:
        if (source / path).exists():
            texts[path] = (source / path).read_text(encoding="utf-8")
    return (match.group(1) if match else None), texts


def fingerprints_with(python: str, texts: dict[str, str]) -> dict[str, str | None]:
    """Each site's fingerprint as ``python`` computes it (None: site absent)."""
    request = {
        key: (texts[path], class_name, method)
        for key, (path, class_name, method) in SITES.items()
        if path in texts
    }
    result = subprocess.run(
        [python, "-I", "-c", _CHILD, fingerprint.__file__],
        input=json.dumps(request),
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise RuntimeError(f"{python} could not fingerprint: {result.stderr.strip()}")
    answers: dict[str, str | None] = json.loads(result.stdout)
    return {key: answers.get(key) for key in SITES}


@dataclass(frozen=True)
class Verdict:
    """One vLLM's sites under every interpreter, judged against the table."""

    version: str | None
    by_python: dict[str, dict[str, str | None]]
    problems: tuple[str, ...]


def judge(version: str | None, by_python: dict[str, dict[str, str | None]]) -> Verdict:
    """Every interpreter must agree, and a known release must be recognized."""
    problems: list[str] = []
    for key in SITES:
        seen = {python: answers[key] for python, answers in by_python.items()}
        if len(set(seen.values())) > 1:
            problems.append(f"{key}: interpreters disagree: {seen}")
    expected = expected_body(version)
    for python, answers in by_python.items():
        if expected is not None and answers["split"] != expected.fingerprint:
            problems.append(
                f"split on Python {python}: {answers['split']}, the table says "
                f"{expected.fingerprint} (body {expected.name})"
            )
        seed = answers["seed"]
        if seed is not None and seed_code(seed) is None:
            problems.append(f"seed on Python {python}: {seed} is in no SEED_BODIES")
        info = answers["group_info"]
        if seed is not None and info is not None and info not in GROUP_INFO_BODIES:
            problems.append(f"group_info on Python {python}: {info} is not known")
    return Verdict(version, by_python, tuple(problems))


def check(source: Path, pythons: dict[str, str]) -> Verdict:
    version, texts = read_sites(source)
    by_python = {
        version_name: fingerprints_with(binary, texts)
        for version_name, binary in pythons.items()
    }
    return judge(version, by_python)


def available_pythons(
    versions: tuple[str, ...] = SUPPORTED_PYTHONS,
) -> tuple[dict[str, str], list[str]]:
    """The interpreters found, and the versions not found."""
    found: dict[str, str] = {}
    missing: list[str] = []
    for version in versions:
        binary = find_python(version)
        if binary is None:
            missing.append(version)
        else:
            found[version] = binary
    return found, missing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sources", nargs="*", type=Path, help="vLLM wheels")
    parser.add_argument(
        "--installed", action="store_true", help="the vLLM installed here"
    )
    args = parser.parse_args(argv)
    sources = list(args.sources)
    if args.installed:
        import importlib.util

        spec = importlib.util.find_spec("vllm")
        if spec is None or spec.origin is None:
            parser.error("vLLM is not installed in this Python")
        sources.append(Path(spec.origin).parent)
    if not sources:
        parser.error("name vLLM wheels, or --installed")
    pythons, missing = available_pythons()
    if missing:
        print(f"interpreters not found: {', '.join(missing)}", file=sys.stderr)
        return 2
    failed = 0
    print(f"{'vLLM':10} {'site':11} " + " ".join(f"{p:17}" for p in pythons))
    for source in sources:
        verdict = check(source, pythons)
        for key in SITES:
            row = [verdict.by_python[p][key] or "-" for p in pythons]
            print(
                f"{verdict.version or '?':10} {key:11} "
                + " ".join(f"{r:17}" for r in row)
            )
        for problem in verdict.problems:
            print(f"  PROBLEM {problem}")
        failed += bool(verdict.problems)
    print(
        f"{len(sources) - failed} of {len(sources)} vLLM builds recognized alike on "
        f"Python {', '.join(pythons)}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
