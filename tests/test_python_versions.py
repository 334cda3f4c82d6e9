"""The installed vLLM is recognized alike by every Python vLLM runs on.

vLLM's wheels are abi3 (one wheel, Python 3.10-3.13) and its official image runs
3.12: the plugin must read the installed release's code as the same verified
entry on each interpreter, or it refuses to start hybrid models there. Each
interpreter fingerprints the installed files with the plugin's own
fingerprint.py; the answers must agree with each other and with the release
table.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from maintainers.interpreters import available_pythons, check
from vllm_mamba_align.releases import expected_body, installed_version


def test_every_supported_python_recognizes_the_installed_release() -> None:
    import vllm

    pythons, missing = available_pythons()
    if missing and os.environ.get("CI"):
        pytest.fail(f"CI lacks Python {', '.join(missing)}: cannot prove the claim")
    if len(pythons) < 2:
        pytest.skip("fewer than two supported interpreters here")
    expected = expected_body(installed_version())
    assert expected is not None, "the suite runs on verified releases"
    verdict = check(Path(vllm.__file__).parent, pythons)
    assert verdict.problems == ()
    assert {answers["split"] for answers in verdict.by_python.values()} == {
        expected.fingerprint
    }
