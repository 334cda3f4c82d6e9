"""Settings from the environment (no vLLM needed)."""

from __future__ import annotations

import pytest

from vllm_mamba_align import MambaAlignError, settings
from vllm_mamba_align.settings import Mode


@pytest.mark.parametrize(
    ("raw", "mode"),
    [
        (None, Mode.LEAN),
        ("", Mode.LEAN),
        ("  ", Mode.LEAN),
        (" full", Mode.FULL),
        ("grid", Mode.GRID),
        ("Lean", Mode.LEAN),
        (" KEPT ", Mode.KEPT),
        ("Audit", Mode.AUDIT),
        ("off", Mode.OFF),
    ],
)
def test_modes_are_read_trimmed_and_case_blind(
    raw: str | None, mode: Mode, monkeypatch: pytest.MonkeyPatch
) -> None:
    if raw is None:
        monkeypatch.delenv(settings.MODE_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(settings.MODE_VARIABLE, raw)
    assert settings.read_mode() is mode


def test_a_bad_mode_names_the_variable_and_the_valid_values(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(settings.MODE_VARIABLE, "sideways")
    with pytest.raises(MambaAlignError) as error:
        settings.read_mode()
    message = str(error.value)
    assert "VLLM_MAMBA_ALIGN_MODE='sideways' is not a valid mode" in message
    assert "full, kept, grid, lean, off, audit" in message


@pytest.mark.parametrize(
    ("raw", "allowed"),
    [
        (None, False),
        ("", False),
        ("0", False),
        ("1", True),
        ("Yes", True),
        ("on", True),
    ],
)
def test_the_unverified_opt_in(
    raw: str | None, allowed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if raw is None:
        monkeypatch.delenv(settings.ALLOW_UNVERIFIED_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(settings.ALLOW_UNVERIFIED_VARIABLE, raw)
    assert settings.allow_unverified() is allowed


@pytest.mark.parametrize("mode", ["off", "lean", "audit"])
def test_off_reads_no_setting_but_its_own(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``off`` changes nothing, so a bad value of a setting only the fix or the
    audit reads stops no vLLM in ``off`` (register() and doctor alike); in
    every other mode it does."""
    monkeypatch.setenv(settings.MODE_VARIABLE, mode)
    monkeypatch.setenv(settings.AUDIT_INTERVAL_VARIABLE, "abc")
    if mode == "off":
        settings.check_startup()
        assert settings.startup_problems() == []
        return
    with pytest.raises(MambaAlignError, match="AUDIT_INTERVAL='abc'"):
        settings.check_startup()
    assert len(settings.startup_problems()) == 1
