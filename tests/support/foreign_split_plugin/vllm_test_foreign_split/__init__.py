"""Test-only stand-in for another vLLM plugin that patches the same split.

vllm-ascend replaces ``Scheduler._mamba_block_aligned_split`` with a
``functools.wraps`` wrapper of vLLM's function in its platform patches, and
vllm-gaudi's ``HPUAsyncScheduler`` overrides it. This distribution does the same
things, with both entry points vLLM loads, so the tests can watch vllm-mamba-align
meet them on the real scheduler. It does nothing unless
``MAMBA_ALIGN_TEST_FOREIGN_SPLIT`` names a way (:data:`WAYS`):

- ``wraps-at-platform``: its platform plugin is selected (a CPU platform) and,
  while vLLM resolves the platform (before any general plugin loads), arranges
  for the wrapper to be installed when the scheduler module is imported;
- ``wraps-at-pre-register``: the same platform installs the wrapper in
  ``pre_register_and_update``, which vLLM calls when it builds the engine config
  (after the general plugins loaded), as vllm-ascend does;
- ``wrapt-at-general``: its general plugin wraps the split with wrapt when the
  scheduler module is imported (the order relative to other general plugins is
  vLLM's entry-point order).

- ``<pattern>-swap-at-platform`` / ``<pattern>-swap-at-pre-register``, and
  ``swap-at-…``: the platform puts a subclass of vLLM's ``Scheduler`` in its
  module's place, at either time, as vllm-ascend's ``BalanceScheduler``
  (swap.py): ``swap`` inherits the split and has a copied ``schedule()``;
  ``wraps-swap`` first wraps the split as above, then swaps (vllm-ascend
  0.30.0rc2's order); ``altered-swap`` copies ``schedule()`` with the split's
  arguments changed; ``override-swap`` swaps in a subclass with its own split.

The platform ways need ``VLLM_TARGET_DEVICE`` set to something other than
``cpu``: vLLM 0.33.0 consults no platform plugin for an explicit CPU target.
The subclass override (``scheduler.ForeignAsyncScheduler``) is used only by a
test that builds it. Every layer counts its calls in :data:`patches.CALLS`.
"""

from __future__ import annotations

import os

VARIABLE = "MAMBA_ALIGN_TEST_FOREIGN_SPLIT"
SWAPS = ("swap", "wraps-swap", "altered-swap", "override-swap")
WHEN = ("platform", "pre-register")
WAYS = (
    "wraps-at-platform",
    "wraps-at-pre-register",
    "wrapt-at-general",
    *(f"{swap}-at-{when}" for swap in SWAPS for when in WHEN),
)
SCHEDULER_MODULE = "vllm.v1.core.sched.scheduler"


def way() -> str | None:
    chosen = os.environ.get(VARIABLE) or None
    if chosen is not None and chosen not in WAYS:
        raise ValueError(f"{VARIABLE}={chosen!r}: expected one of {WAYS}")
    return chosen


def platform() -> str | None:
    """``vllm.platform_plugins`` entry point: a CPU platform, for the platform ways."""
    chosen = way()
    if chosen is None or chosen == "wrapt-at-general":
        return None
    if chosen.endswith("-at-platform"):
        import wrapt

        from .patches import install_platform_patches

        wrapt.register_post_import_hook(install_platform_patches, SCHEDULER_MODULE)
    return "vllm_test_foreign_split.platform.ForeignCpuPlatform"


def register() -> None:
    """``vllm.general_plugins`` entry point."""
    if way() != "wrapt-at-general":
        return
    import wrapt

    from .patches import install_wrapt_hook

    wrapt.register_post_import_hook(install_wrapt_hook, SCHEDULER_MODULE)
