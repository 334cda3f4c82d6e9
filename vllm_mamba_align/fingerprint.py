"""Recognize vLLM's code by what it does, not by a version string.

Vendor and dev builds report versions like ``0.1.dev20073+g8e685d198`` (or ``dev``),
so a version range cannot tell which algorithm is installed. The fingerprint is a
hash of the function's syntax tree in a canonical text form: comments, the
docstring, formatting and line numbers do not count; any change to what the code
does does.

The canonical form must mean the same code on every Python vLLM runs on
(3.10-3.13: its wheels are abi3, and vLLM's official image runs 3.12).
``ast.dump`` cannot be hashed for that: 3.12 adds a ``type_params`` field to
every function node and 3.13 stops printing empty fields. :func:`canonical_form`
writes the tree itself, by fixed rules that give the text Python 3.10 and 3.11's
``ast.dump(node)`` give, so the fingerprints recorded in releases.py hold on
every interpreter.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# The parameters every released split function starts with (0.15.0 ... 0.34.0).
SPLIT_PARAMETERS = (
    "self",
    "request",
    "num_new_tokens",
    "num_new_local_computed_tokens",
    "num_external_computed_tokens",
)


@dataclass(frozen=True)
class CodeShape:
    """What the plugin learned about one installed split function."""

    fingerprint: str | None
    """16 hex digits, or None when the source cannot be read."""
    grid_reads: int
    """How often the function reads ``self.cache_config.block_size`` (the grid)."""
    parameters: tuple[str, ...]
    names: frozenset[str]
    """Names the function uses, and ``name.attribute`` reads (``self.x``)."""
    problem: str | None = None
    """Why the source could not be analysed, if it could not."""
    source: str | None = None
    """The function's source, for what only unverified code needs read from it
    (unverified.py)."""

    @property
    def structurally_compatible(self) -> bool:
        """The minimum the fix relies on: one grid read, a known call signature.

        The signature is the released one, optionally with one more parameter
        (as 0.24.0-0.25.1 have), which the fix passes through unchanged.
        """
        return (
            self.grid_reads == 1
            and self.parameters[: len(SPLIT_PARAMETERS)] == SPLIT_PARAMETERS
            and len(self.parameters) <= len(SPLIT_PARAMETERS) + 1
        )


def _without_docstring(node: ast.FunctionDef) -> ast.FunctionDef:
    body = node.body
    if (
        body
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        node.body = body[1:]
    return node


def function_def(source: str) -> ast.FunctionDef:
    """The one function ``source`` defines, without its docstring."""
    tree = ast.parse(textwrap.dedent(source))
    node = tree.body[0]
    if not isinstance(node, ast.FunctionDef):
        raise ValueError("source is not a plain function definition")
    return _without_docstring(node)


# Fields whose value may be None without being optional in Python's grammar (the
# value of a ``None`` literal): written out, where other None fields are left out.
_VALUE_FIELDS = frozenset({("Constant", "value"), ("MatchSingleton", "value")})
# Fields that grammars after 3.11 added to existing nodes, left out while empty:
# code that also runs on 3.10 and 3.11 never fills them.
_NEWER_FIELDS = frozenset({"type_params"})


def _is_empty_text(node: object) -> bool:
    return isinstance(node, ast.Constant) and node.value == ""


def canonical_form(node: object) -> str:
    """The syntax tree as text, the same on every interpreter from 3.10 on.

    A node is ``Name(field=value, ...)`` over its fields in grammar order; a
    list is ``[a, b]``; anything else is its ``ascii`` (``repr`` would depend
    on the interpreter's Unicode tables for non-ASCII text). Left out: optional
    fields holding None, empty fields added after 3.11, and empty text pieces
    of an f-string (3.12.0-3.12.1 add one after a nested format field). For
    code whose literals are ASCII this is exactly what ``ast.dump(node)`` prints
    on Python 3.10 and 3.11 (a unit test holds the two equal there).
    """
    if isinstance(node, ast.AST):
        kind = type(node).__name__
        fields = []
        for name in node._fields:
            value = getattr(node, name, None)
            if value is None and (kind, name) not in _VALUE_FIELDS:
                continue
            if name in _NEWER_FIELDS and value == []:
                continue
            if isinstance(node, ast.JoinedStr) and name == "values":
                value = [piece for piece in node.values if not _is_empty_text(piece)]
            fields.append(f"{name}={canonical_form(value)}")
        return f"{kind}({', '.join(fields)})"
    if isinstance(node, list):
        return f"[{', '.join(canonical_form(item) for item in node)}]"
    return ascii(node)


def fingerprint_node(node: ast.FunctionDef) -> str:
    """Hash of one function's canonical syntax tree (docstring already removed)."""
    return hashlib.sha256(canonical_form(node).encode()).hexdigest()[:16]


def fingerprint_source(source: str) -> str:
    """Hash of the normalized syntax tree of one function's source text."""
    return fingerprint_node(function_def(source))


def method_in_file(path: str, class_name: str, method: str) -> ast.FunctionDef | None:
    """``class_name.method`` as found in a module's source file, docstring removed.

    For code that must not be imported (Model Runner V2's module imports GPU
    kernels). Its :func:`fingerprint_node` equals :func:`analyse_function`'s
    fingerprint of the same method imported: both hash the same syntax tree.
    Raises ``OSError``/``SyntaxError``/``ValueError`` when the file is unreadable.
    """
    with open(path, encoding="utf-8") as source:
        return method_in_source(source.read(), class_name, method)


def method_in_source(
    module_source: str, class_name: str, method: str
) -> ast.FunctionDef | None:
    """``class_name.method`` as found in a module's source text, docstring removed."""
    tree = ast.parse(module_source)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == method:
                    return _without_docstring(item)
    return None


def _is_grid_read(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "block_size"
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "cache_config"
        and isinstance(node.value.value, ast.Name)
        and node.value.value.id == "self"
    )


def analyse_source(source: str) -> CodeShape:
    """Fingerprint and structural facts of one function's source text."""
    node = function_def(source)
    names: set[str] = set()
    grid_reads = 0
    for child in ast.walk(node):
        if _is_grid_read(child):
            grid_reads += 1
        if isinstance(child, ast.Name):
            names.add(child.id)
        elif isinstance(child, ast.Attribute) and isinstance(child.value, ast.Name):
            names.add(f"{child.value.id}.{child.attr}")
    args = node.args
    parameters = tuple(a.arg for a in (*args.posonlyargs, *args.args))
    return CodeShape(
        fingerprint=fingerprint_source(source),
        grid_reads=grid_reads,
        parameters=parameters,
        names=frozenset(names),
        source=source,
    )


def analyse_function(function: Callable[..., Any]) -> CodeShape:
    """Like :func:`analyse_source`, for a live function (its source must be on disk)."""
    try:
        source = inspect.getsource(function)
        return analyse_source(source)
    except (OSError, TypeError, SyntaxError, ValueError) as exc:
        return CodeShape(
            fingerprint=None,
            grid_reads=0,
            parameters=(),
            names=frozenset(),
            problem=f"source not readable: {exc}",
        )
