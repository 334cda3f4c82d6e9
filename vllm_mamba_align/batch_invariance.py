"""What the installed vLLM does with its batch-invariant mode for hybrid models.

Read from vLLM's code, never from its version, so a dev, nightly or vendor
build answers as its code does; tests/test_release_facts.py holds the reading
to the release table (``releases.SELECTOR_ASKS_BATCH_INVARIANCE``) on every
release of the matrix. Loaded only where the answer is needed: the start line
when ``VLLM_BATCH_INVARIANT`` is on (messages.py), and ``doctor``.

Importing this module needs neither vLLM nor torch.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

from . import releases

SELECTOR_FILE = "v1/attention/selector.py"
"""Where vLLM selects a Mamba attention backend, relative to its package directory."""
BATCH_INVARIANCE_CHECK = "supports_batch_invariance"
"""The backend method vLLM's Mamba backend selector asks when
``VLLM_BATCH_INVARIANT=1`` (``get_mamba_attn_backend``;
``_cached_get_mamba_attn_backend`` in 0.33.0): the base class answers False and
no Mamba/GDN backend overrides it before 0.34.0 (0.34.0: the short-convolution
backend answers True, :func:`mamba_backends_accepting_batch_invariance`), so
where the selector asks, vLLM raises ``RuntimeError("VLLM batch_invariant mode
is not supported for …")`` while the worker loads the model, before the engine
core builds its scheduler and before the plugin's start line. Which releases
ask: ``releases.SELECTOR_ASKS_BATCH_INVARIANCE``; the others have the mode and
take every Mamba backend."""


@functools.cache
def _selector_asks_batch_invariance(selector: Path) -> bool | None:
    try:
        tree = ast.parse(selector.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None
    return any(
        isinstance(node, ast.Attribute) and node.attr == BATCH_INVARIANCE_CHECK
        for function in ast.walk(tree)
        if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef)
        and "mamba_attn_backend" in function.name
        for node in ast.walk(function)
    )


def refuses_batch_invariance_for_mamba() -> bool:
    """Whether the installed vLLM refuses batch-invariant mode for hybrid models.

    Read from the installed selector (:data:`SELECTOR_FILE`): a function selecting
    Mamba backends that asks :data:`BATCH_INVARIANCE_CHECK`. The version is not
    consulted, so a dev, nightly or vendor build answers as its code does. True
    when the file cannot be read: the newest releases refuse."""
    root = releases.vllm_package_dir()
    answer = (
        None if root is None else _selector_asks_batch_invariance(root / SELECTOR_FILE)
    )
    return True if answer is None else answer


BACKEND_REGISTRY_FILE = "v1/attention/backends/registry.py"
"""Where vLLM names its Mamba attention backends (``MambaAttentionBackendEnum``:
member name = ``"module.path.ClassName"``), on every supported release."""
MAMBA_BACKEND_ENUM = "MambaAttentionBackendEnum"


def _answers_true(function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    returns = [n for n in ast.walk(function) if isinstance(n, ast.Return)]
    return bool(returns) and all(
        isinstance(r.value, ast.Constant) and r.value.value is True for r in returns
    )


@functools.cache
def _backends_accepting(root: Path) -> tuple[str, ...]:
    try:
        registry = ast.parse((root / BACKEND_REGISTRY_FILE).read_text("utf-8"))
    except (OSError, SyntaxError, ValueError):
        return ()
    paths: dict[str, str] = {}
    for node in ast.walk(registry):
        if isinstance(node, ast.ClassDef) and node.name == MAMBA_BACKEND_ENUM:
            for item in node.body:
                if (
                    isinstance(item, ast.Assign)
                    and len(item.targets) == 1
                    and isinstance(item.targets[0], ast.Name)
                    and isinstance(item.value, ast.Constant)
                    and isinstance(item.value.value, str)
                ):
                    paths[item.targets[0].id] = item.value.value
    accepting = []
    for name, path in paths.items():
        module, _, class_name = path.rpartition(".")
        relative = module.removeprefix("vllm.").replace(".", "/") + ".py"
        try:
            tree = ast.parse((root / relative).read_text("utf-8"))
        except (OSError, SyntaxError, ValueError):
            continue
        if any(
            isinstance(node, ast.ClassDef)
            and node.name == class_name
            and any(
                isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
                and item.name == BATCH_INVARIANCE_CHECK
                and _answers_true(item)
                for item in node.body
            )
            for node in tree.body
        ):
            accepting.append(name)
    return tuple(accepting)


def mamba_backends_accepting_batch_invariance() -> tuple[str, ...]:
    """The installed vLLM's Mamba attention backends whose class answers
    :data:`BATCH_INVARIANCE_CHECK` with True, by their enum names: none through
    0.33.0; ``SHORT_CONV`` (short convolutions, LFM2's layers) from 0.34.0. vLLM's
    selector lets those run batch-invariant while it refuses the others. Read
    from the code (:data:`BACKEND_REGISTRY_FILE` and each backend's module);
    () when it cannot be read or vLLM is not installed."""
    root = releases.vllm_package_dir()
    return () if root is None else _backends_accepting(root)
