"""Drafting into the release table: releases.py's text, edited in place.

A known body gains the release (and the worker-seed ranges extend to it);
an unknown one is inserted as a drafted entry, in release order. Edits keep
the file's formatting (one argument per line, the line length) so that the
diff a maintainer reviews is the change and nothing else.
"""

from __future__ import annotations

import ast
import difflib

from packaging.version import Version

from maintainers import drafting
from maintainers.onboard import REPO, OnboardError
from vllm_mamba_align import releases

RELEASES_PY = REPO / "vllm_mamba_align" / "releases.py"


def _body_string_node(tree: ast.Module, fingerprint: str) -> ast.Constant | None:
    """The releases string of the ``_body(...)`` call holding ``fingerprint``."""
    call = _body_call(tree, fingerprint)
    if call is None or not isinstance(call.args[0], ast.Constant):
        return None
    return call.args[0]


def _body_call(tree: ast.Module, fingerprint: str) -> ast.Call | None:
    """The ``_body(...)`` call holding ``fingerprint``."""
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "_body"
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value == fingerprint
        ):
            return node
    return None


LINE_LENGTH = 88
"""ruff's line length (pyproject.toml): releases.py as edited must pass lint."""


def _replace_constant(text: str, node: ast.Constant, new: str) -> str:
    """``text`` with the string ``node`` (on one line or an implicit
    concatenation over several) replaced by ``new``: on one line when it fits,
    else as ruff formats a string too long for its line, an implicit
    concatenation of lines at the string's indentation (the string alone on its
    lines, as in a call written one argument per line)."""
    lines = text.splitlines(keepends=True)
    assert node.end_lineno is not None and node.end_col_offset is not None
    before = lines[node.lineno - 1][: node.col_offset]
    after = lines[node.end_lineno - 1][node.end_col_offset :]
    rendered = f'"{new}"'
    if len(before + rendered + after.rstrip("\n")) > LINE_LENGTH:
        room = LINE_LENGTH - len(before) - len(after.rstrip("\n")) - 3  # quotes, space
        parts: list[str] = []
        for word in new.split():
            if parts and len(parts[-1]) + 1 + len(word) <= room:
                parts[-1] += f" {word}"
            else:
                parts.append(word)
        rendered = f"\n{' ' * len(before)}".join(
            f'"{part} "' if index < len(parts) - 1 else f'"{part}"'
            for index, part in enumerate(parts)
        )
    lines[node.lineno - 1 : node.end_lineno] = [before + rendered + after]
    return "".join(lines)


def _one_argument_per_line(text: str, call: ast.Call) -> str:
    """``text`` with a call written on one line rewritten one argument per line
    (as ruff formats a call too long for its line); others as they are."""
    assert call.end_lineno is not None and call.end_col_offset is not None
    if call.lineno != call.end_lineno:
        return text
    lines = text.splitlines(keepends=True)
    line = lines[call.lineno - 1]
    indent = line[: len(line) - len(line.lstrip())]
    arguments = [
        ast.get_source_segment(text, node) for node in (*call.args, *call.keywords)
    ]
    head = line[: call.func.end_col_offset] + "(\n"
    body = "".join(f"{indent}    {argument},\n" for argument in arguments)
    lines[call.lineno - 1] = head + body + indent + ")" + line[call.end_col_offset :]
    return "".join(lines)


def add_release_to_body(text: str, fingerprint: str, release: str) -> str:
    """releases.py's text with ``release`` added to the entry of ``fingerprint``."""
    node = _body_string_node(ast.parse(text), fingerprint)
    if node is None or not isinstance(node.value, str):
        raise OnboardError(f"no _body(...) entry with fingerprint {fingerprint}")
    listed = node.value.split()
    if release in listed:
        return text
    joined = " ".join(sorted({*listed, release}, key=Version))
    edited = _replace_constant(text, node, joined)
    call = _body_call(ast.parse(text), fingerprint)
    assert call is not None
    if call.lineno == call.end_lineno and edited.count("\n") > text.count("\n"):
        text = _one_argument_per_line(text, call)  # too long for one line now
        node = _body_string_node(ast.parse(text), fingerprint)
        assert node is not None
        edited = _replace_constant(text, node, joined)
    return edited


def _bodies_tuple(tree: ast.Module) -> ast.Tuple:
    for node in tree.body:
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and node.target.id == "BODIES"
            and isinstance(node.value, ast.Tuple)
        ):
            return node.value
    raise OnboardError("releases.py has no BODIES = (...) tuple")


def _first_label(call: ast.expr, nightlies: bool = False) -> Version | None:
    """An entry's first release; with ``nightlies``, else its first nightly
    build (None: neither, or not an entry)."""
    if not (
        isinstance(call, ast.Call)
        and call.args
        and isinstance(call.args[0], ast.Constant)
        and isinstance(call.args[0].value, str)
    ):
        return None
    labels = call.args[0].value.split()
    if not labels and nightlies:
        labels = [
            word
            for keyword in call.keywords
            if keyword.arg == "nightlies" and isinstance(keyword.value, ast.Constant)
            for word in str(keyword.value.value).split()
        ]
    return Version(labels[0]) if labels else None


def insert_body(text: str, entry: str) -> str:
    """releases.py's text with a drafted entry added to ``BODIES``, in release
    order: before the first entry whose first release (or, naming none, first
    nightly build) has a higher version number."""
    bodies = _bodies_tuple(ast.parse(text))
    call = ast.parse(entry.rstrip().rstrip(","), mode="eval").body
    release = _first_label(call, nightlies=True)
    if release is None:
        raise OnboardError(f"a drafted entry names no release or build:\n{entry}")
    assert bodies.end_lineno is not None
    line = bodies.end_lineno  # the closing paren's line (1-based)
    for element in bodies.elts:
        first = _first_label(element, nightlies=True)
        if first is not None and first > release:
            line = element.lineno
            break
    lines = text.splitlines(keepends=True)
    indented = "".join(f"    {row}\n" for row in entry.splitlines())
    lines.insert(line - 1, indented)
    return "".join(lines)


def remove_release(text: str, release: str) -> str:
    """releases.py's text as if the table did not know ``release``: dropped
    from its entry's releases, or the entry removed when it was the only one."""
    for element in _bodies_tuple(ast.parse(text)).elts:
        if not (isinstance(element, ast.Call) and element.args):
            continue
        first = element.args[0]
        if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
            continue
        listed = first.value.split()
        if release not in listed:
            continue
        if len(listed) > 1:
            kept = " ".join(r for r in listed if r != release)
            return _replace_constant(text, first, kept)
        assert element.end_lineno is not None
        lines = text.splitlines(keepends=True)
        del lines[element.lineno - 1 : element.end_lineno]
        return "".join(lines)
    return text


def _range_string_node(tree: ast.Module, fingerprint: str) -> ast.Constant | None:
    """The release-range string paired with ``fingerprint`` in the seed tables:
    ``SeedCode("a-b", fingerprint, ...)`` or ``GROUP_INFO_BODIES``' entry
    ``fingerprint: "a-b"``. Found by its fingerprint, so a range that reads
    like some other string in the file (a one-release range is also a body's
    releases string) is never the one changed."""
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "SeedCode"
            and len(node.args) >= 2
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value == fingerprint
        ):
            return node.args[0]
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if (
                    isinstance(key, ast.Constant)
                    and key.value == fingerprint
                    and isinstance(value, ast.Constant)
                    and isinstance(value.value, str)
                ):
                    return value
    return None


def _extend_range(text: str, fingerprint: str, release: str) -> str:
    """The seed range ``a-b`` (or ``a``) paired with ``fingerprint`` stretched
    to include ``release``."""
    node = _range_string_node(ast.parse(text), fingerprint)
    if node is None:
        return text
    first, _, last = str(node.value).partition("-")
    last = last or first
    releases_in = sorted({first, last, release}, key=Version)
    new = (
        releases_in[0]
        if releases_in[0] == releases_in[-1]
        else f"{releases_in[0]}-{releases_in[-1]}"
    )
    return _replace_constant(text, node, new)


def extend_seed_ranges(text: str, seed: drafting.SeedReading, release: str) -> str:
    """releases.py with the seed fingerprints' release ranges covering ``release``."""
    if seed.add_request is not None and releases.seed_code(seed.add_request):
        text = _extend_range(text, seed.add_request, release)
    if seed.group_info in releases.GROUP_INFO_BODIES:
        text = _extend_range(text, seed.group_info, release)
    return text


def text_diff(before: str, after: str, name: str) -> str:
    return "".join(
        difflib.unified_diff(
            before.splitlines(keepends=True),
            after.splitlines(keepends=True),
            fromfile=f"a/{name}",
            tofile=f"b/{name}",
        )
    )
