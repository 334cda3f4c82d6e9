"""A fingerprint means the same code on every Python vLLM runs on (no vLLM needed).

vLLM's abi3 wheels run on Python 3.10-3.13 and its official image runs 3.12;
the release table's fingerprints must come out the same on each. The
real-scheduler suite checks the installed vLLM's own code the same way
(tests/test_python_versions.py).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import sys
import textwrap

import pytest

from maintainers import interpreters
from maintainers.interpreters import (
    SUPPORTED_PYTHONS,
    available_pythons,
    fingerprints_with,
)
from vllm_mamba_align import fingerprint
from vllm_mamba_align.fingerprint import canonical_form, fingerprint_source

# Syntax whose tree, or whose ast.dump, differs between interpreters: f-strings
# with nested format specs (3.12.0-3.12.1 add an empty piece), a None literal
# (a value, not an absent field), non-ASCII text (repr follows the Unicode
# tables), defaults, keyword-only arguments, match, walrus, slices.
TRICKY = '''
def _mamba_block_aligned_split(
    self, request, num_new_tokens, *, width: int = 8, label=None
):
    """A docstring."""
    block_size = self.cache_config.block_size
    note = f"{request.id!r:>{width}} ends at {num_new_tokens:{width}}"
    note += f" \u2264 {block_size:{width}}"
    if (start := request.num_computed_tokens) is None:
        return None
    match request.status:
        case "waiting" | "preempted":
            stops = [b for b in range(start, start + num_new_tokens)][1:-1:2]
        case {"kind": kind, **rest} if kind:
            stops = (kind, rest)
        case _:
            stops = ()
    logger.debug("%s \u2192 %s", note, stops, extra={"label": label or "\u00e9"})
    return num_new_tokens // block_size * block_size - start
'''


def _supported_pythons() -> dict[str, str]:
    """Every supported interpreter on this machine; CI must have all four."""
    found, missing = available_pythons()
    if missing and os.environ.get("CI"):
        pytest.fail(f"CI lacks Python {', '.join(missing)}: cannot prove the claim")
    if len(found) < 2:
        pytest.skip("fewer than two supported interpreters here")
    return found


def test_every_supported_interpreter_fingerprints_the_same_code_alike() -> None:
    pythons = _supported_pythons()
    module = f"class Scheduler:\n{textwrap.indent(TRICKY, '    ')}"
    request = {interpreters.SCHEDULER_FILE: module}
    answers = {
        python: fingerprints_with(binary, request)["split"]
        for python, binary in pythons.items()
    }
    assert set(answers.values()) == {fingerprint_source(TRICKY)}, answers


def test_a_change_of_code_still_changes_the_fingerprint_everywhere() -> None:
    pythons = _supported_pythons()
    edited = TRICKY.replace("[1:-1:2]", "[1:-1:3]")
    for source in (TRICKY, edited):
        module = f"class Scheduler:\n{textwrap.indent(source, '    ')}"
        request = {interpreters.SCHEDULER_FILE: module}
        answers = {fingerprints_with(b, request)["split"] for b in pythons.values()}
        assert answers == {fingerprint_source(source)}
    assert fingerprint_source(edited) != fingerprint_source(TRICKY)


LEGACY_FORM = sys.version_info[:2] in ((3, 10), (3, 11))


@pytest.mark.skipif(not LEGACY_FORM, reason="ast.dump's form of Python 3.10/3.11")
@pytest.mark.parametrize("module", [ast, inspect, dataclasses, fingerprint, os])
def test_the_canonical_form_is_what_python_3_10_and_3_11_dump(module: object) -> None:
    """The release table was recorded as hashes of 3.10/3.11's ast.dump: the
    canonical form reproduces it there, so every recorded fingerprint stands."""
    tree = ast.parse(inspect.getsource(module))  # type: ignore[arg-type]
    functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
    assert len(functions) > 10
    for node in functions:
        assert canonical_form(node) == ast.dump(node), node.name


def test_non_ascii_text_is_written_as_escapes_on_every_python() -> None:
    """repr() of non-ASCII text follows the interpreter's Unicode tables."""
    assert "\\u2264" in canonical_form(ast.parse(TRICKY))
    assert canonical_form(ast.parse("x = 'caf\u00e9'")) == (
        "Module(body=[Assign(targets=[Name(id='x', ctx=Store())], "
        "value=Constant(value='caf\\xe9'))], type_ignores=[])"
    )


def test_the_supported_pythons_are_the_ones_the_package_declares() -> None:
    from importlib import metadata

    classifiers = metadata.metadata("vllm-mamba-align").get_all("Classifier") or []
    declared = {
        c.rsplit(" :: ", 1)[1]
        for c in classifiers
        if c.startswith("Programming Language :: Python :: 3.")
    }
    assert declared == set(SUPPORTED_PYTHONS)
    requires = metadata.metadata("vllm-mamba-align")["Requires-Python"]
    assert requires == f">={SUPPORTED_PYTHONS[0]}"


def test_a_mismatch_names_the_python_that_compared_and_the_cause() -> None:
    from vllm_mamba_align.releases import describe_mismatch

    said = describe_mismatch("0.33.0", "f3405419e904a2f8", "44a4010f8b7ebb3c")
    python = ".".join(map(str, sys.version_info[:3]))
    assert "vLLM 0.33.0 as released has split fingerprint f3405419e904a2f8" in said
    assert f"this Python {python} computed 44a4010f8b7ebb3c" in said
    assert "every Python from 3.10 to 3.13" in said
    assert "differs from the release's" in said


def test_outside_the_tested_pythons_the_interpreter_is_named_as_a_cause(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm_mamba_align.releases import describe_mismatch

    monkeypatch.setattr(sys, "version_info", (3, 14, 0, "final", 0))
    said = describe_mismatch("0.33.0", "f3405419e904a2f8", "0123456789abcdef")
    assert "Python 3.14.0 reads the same code differently" in said
    assert "tested on Python 3.10-3.13" in said
