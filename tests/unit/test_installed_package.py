"""The suites judge the package users install, not the checkout beside them.

A module left out of the wheel, a file missing from its package data, an entry
point that names the wrong function: each passes a suite that imports the
checkout's ``vllm_mamba_align``. nox installs the wheel it built and sets
``MAMBA_ALIGN_INSTALLED_PACKAGE``; then the package must come from the
environment's site-packages (tests/helpers.py's ``run_python`` gives the
fresh interpreters it starts the same package). Outside nox (an editable
install, a checkout on ``sys.path``) the choice is the developer's, and the
test says so and skips.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import pytest

import vllm_mamba_align

CHECKOUT = Path(__file__).resolve().parents[2]
INSTALLED_PACKAGE = "MAMBA_ALIGN_INSTALLED_PACKAGE"

pytestmark = pytest.mark.skipif(
    os.environ.get(INSTALLED_PACKAGE) != "1",
    reason=f"not under nox ({INSTALLED_PACKAGE} unset): the package may be "
    "imported from the checkout",
)


def site_packages() -> set[Path]:
    return {
        Path(sysconfig.get_paths()[key]).resolve() for key in ("purelib", "platlib")
    }


def test_the_suite_imports_the_installed_wheel() -> None:
    package = Path(vllm_mamba_align.__file__).resolve().parent
    assert package != CHECKOUT / "vllm_mamba_align", "imported from the checkout"
    # (Not the distribution's record: tests/test_packaging.py uninstalls and
    # reinstalls the wheel, possibly on another worker at this moment.)
    assert package.parent in site_packages()
