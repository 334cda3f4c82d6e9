"""Stock vLLM and the plugin's modes side by side in one process.

``vllm-mamba-align simulate``, the benchmarks and the tests compare stock vLLM
with each plugin mode, interleaved, in one interpreter. Both helpers change
process-wide state for the duration of a ``with`` block only:

- :func:`stock_vllm` puts vLLM's own functions (``__wrapped__``) back on the
  scheduler class and module, in place of the plugin's wrappers;
- :func:`scheduler_mode` sets ``VLLM_MAMBA_ALIGN_MODE``, which the plugin reads
  when a scheduler starts.

Not thread-safe, and never used by the plugin itself.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from ..settings import Mode

STOCK = "stock"
"""vLLM's own code, the plugin's wrappers temporarily removed (not our ``off``)."""
DEFAULT = "default"
"""The plugin with ``VLLM_MAMBA_ALIGN_MODE`` unset: what a user gets who sets
nothing (``settings.DEFAULT_MODE``)."""


def _patched_sites() -> list[tuple[Any, str]]:
    import vllm.v1.core.sched.scheduler as module

    from ..plugin import CHECKPOINT_DECISION
    from ..recognition import SPLIT_METHOD

    return [
        (module.Scheduler, "__init__"),
        (module.Scheduler, SPLIT_METHOD),
        (module, CHECKPOINT_DECISION),
    ]


@contextlib.contextmanager
def stock_vllm() -> Iterator[None]:
    """Run vLLM's unpatched scheduler code inside the block.

    Puts the wrapped originals (``__wrapped__``) back on the class and module, so
    stock and patched can be compared in one process, interleaved.
    """
    from ..plugin import is_patched

    saved = []
    for owner, name in _patched_sites():
        current = vars(owner).get(name)
        if is_patched(current):
            saved.append((owner, name, current))
            setattr(owner, name, current.__wrapped__)
    try:
        yield
    finally:
        for owner, name, current in saved:
            setattr(owner, name, current)


@contextlib.contextmanager
def environment_variable(name: str, value: str | None) -> Iterator[None]:
    """``name`` set to ``value`` (None: unset) inside the block, as it was after."""
    previous = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


@contextlib.contextmanager
def scheduler_mode(mode: str) -> Iterator[None]:
    """Schedulers built and run inside use ``mode``: ``stock``, a plugin mode or
    :data:`DEFAULT` (the variable unset).

    Plugin modes need :func:`vllm_mamba_align.register` to have run in this
    process; the mode is read from the environment at scheduler start.
    """
    from ..settings import MODE_VARIABLE

    if mode == STOCK:
        with stock_vllm():
            yield
        return
    with environment_variable(MODE_VARIABLE, None if mode == DEFAULT else mode):
        yield


def simulated_modes() -> list[str]:
    """``stock`` then every plugin mode with something to show (``off`` is
    stock)."""
    return [STOCK, *(m.value for m in Mode if m is not Mode.OFF)]
