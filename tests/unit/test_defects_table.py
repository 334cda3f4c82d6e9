"""vLLM's own defects (vllm_mamba_align/defects.py): the verdicts doctor gives
for each read release with and without the serve flags, the runner vLLM picks,
and the manual's page held to the table. No vLLM needed (the cited lines are
checked in the installed wheel by tests/test_defects.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_mamba_align import defects
from vllm_mamba_align.defects import V1, V2, Setting, Verdict

REPO = Path(__file__).resolve().parents[2]
ALL = {d.key for d in defects.DEFECTS}
REPORTED = {d.key for d in defects.DEFECTS if not d.confirmed}


def verdicts(setting: Setting) -> dict[str, str]:
    return {d.key: v.value for d, v in defects.assess(setting)}


def keys(setting: Setting, verdict: Verdict) -> set[str]:
    return {d.key for d, v in defects.assess(setting) if v is verdict}


@pytest.mark.parametrize(
    ("release", "variable", "runner"),
    [
        ("0.27.1", None, V1),
        ("0.27.1", "1", V2),
        ("0.29.0", None, V2),
        ("0.29.0", "0", V1),
        ("0.33.0", "false", V1),
        ("0.34.0", "0", V2),  # no V1 (vLLM refuses the variable)
        (None, None, None),
    ],
)
def test_the_runner_vllm_picks_for_a_hybrid(
    release: str | None, variable: str | None, runner: str | None
) -> None:
    assert defects.default_runner(release, variable) == runner


# Each read release: the verdicts without flags (runner as vLLM picks, async on,
# drafter unknown), then with V1 + async + MTP, then with the settings that
# avoid every avoidable row.
EXPECTED = {
    "0.27.1": (
        {"#51571", "#50021", "#50729", "async tail", "#56524"},
        {"#51571"},
    ),
    "0.29.0": ({"#50021", "async tail", "#56524"}, {"#51571"}),
    "0.33.0": ({"#50021", "#56524"}, {"#51571"}),
    "0.34.0": ({"#50021", "#56524"}, set()),
}


@pytest.mark.parametrize("release", sorted(EXPECTED))
def test_without_flags_a_drafters_rows_may_apply_and_strict_passes(
    release: str,
) -> None:
    may, _ = EXPECTED[release]
    setting = Setting(release, defects.default_runner(release, None), True, None)
    assert keys(setting, Verdict.MAY_APPLY) == may
    assert keys(setting, Verdict.APPLIES) == set()
    assert keys(setting, Verdict.REPORTED) == REPORTED
    assert defects.strict_failures(setting) == []


@pytest.mark.parametrize("release", sorted(EXPECTED))
def test_v1_async_mtp_is_strict_failing_where_v1_exists(release: str) -> None:
    """#51571 applies to V1 + async + MTP on 0.27.1-0.33.0; 0.34.0 has no V1.
    Turning async scheduling off clears it, as does Model Runner V2."""
    _, strict = EXPECTED[release]
    setting = Setting(release, V1, True, "mtp")
    assert {d.key for d in defects.strict_failures(setting)} == strict
    assert keys(setting, Verdict.APPLIES) == strict
    for avoided in (
        Setting(release, V1, False, "mtp"),
        Setting(release, V2, True, "mtp"),
    ):
        assert defects.strict_failures(avoided) == [], avoided


@pytest.mark.parametrize("release", sorted(EXPECTED))
def test_without_a_drafter_only_async_and_unknowable_rows_remain(release: str) -> None:
    setting = Setting(release, defects.default_runner(release, None), True, "")
    drafter_rows = {d.key for d in defects.DEFECTS if d.needs_drafter and d.confirmed}
    assert not keys(setting, Verdict.MAY_APPLY) & drafter_rows
    assert not keys(setting, Verdict.APPLIES)


def test_a_release_outside_the_read_span_is_not_claimed() -> None:
    for release in ("0.18.1", "0.35.0", "not-a-version"):
        found = verdicts(Setting(release, V1, True, "mtp"))
        assert {k for k, v in found.items() if v == Verdict.NOT_READ.value} == (
            ALL - REPORTED
        ), release
        assert defects.strict_failures(Setting(release, V1, True, "mtp")) == []


def test_every_row_carries_its_evidence() -> None:
    """A confirmed row cites lines in a read release or names its measuring
    test; an unconfirmed one is rendered as reported upstream."""
    for d in defects.DEFECTS:
        if d.confirmed:
            assert d.measured or set(d.evidence) <= set(defects.READ_RELEASES), d.key
            assert d.measured or d.evidence, d.key
        for release in d.evidence:
            assert release in defects.READ_RELEASES, (d.key, release)
    from maintainers.matrix import defects_table

    table = defects_table()
    for d in defects.DEFECTS:
        (row,) = [line for line in table.splitlines() if f"**{d.key}**" in line]
        assert ("reported upstream, not confirmed here" in row) is not d.confirmed


def test_the_page_shows_the_table() -> None:
    """docs/defects.md's generated block is the table's rendering (one fact,
    one place: `python3 -m maintainers.matrix table` rewrites it)."""
    from maintainers.matrix import defects_table

    page = (REPO / "docs" / "defects.md").read_text()
    begin = page.index("<!-- defects:begin")
    body = page[page.index("\n", begin) + 1 : page.index("<!-- defects:end -->")]
    assert body.strip() == defects_table().strip()


def test_doctor_takes_the_serve_flags() -> None:
    from vllm_mamba_align.cli import _parser

    args = _parser().parse_args(
        [
            "doctor",
            "--runner",
            "v1",
            "--no-async-scheduling",
            "--speculative-method",
            "mtp",
            "--strict",
        ]
    )
    assert (args.runner, args.async_scheduling, args.speculative_method) == (
        "v1",
        False,
        "mtp",
    )
    plain = _parser().parse_args(["doctor"])
    assert (plain.runner, plain.async_scheduling, plain.speculative_method) == (
        None,
        None,
        None,
    )


def test_a_dev_build_within_the_read_span_is_judged_by_its_rows() -> None:
    """A nightly between two read releases (a pre-release by its version) is
    judged as the releases around it: #51571 applies to V1 + async + MTP."""
    setting = Setting("0.33.1.dev5+g0123abc", V1, True, "mtp")
    assert [d.key for d in defects.strict_failures(setting)] == ["#51571"]


@pytest.mark.parametrize("release", sorted(EXPECTED))
def test_doctors_reading_per_release_with_and_without_flags(
    release: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What doctor reports (``doctor.judge_defects``, no vLLM needed): without
    flags nothing fails ``--strict``; with V1, async scheduling and MTP the
    release's strict rows do; ``--no-async-scheduling`` clears them."""
    from vllm_mamba_align.doctor import Intended, judge_defects

    monkeypatch.delenv(defects.RUNNER_VARIABLE, raising=False)
    may, strict = EXPECTED[release]
    words, rows, failing = judge_defects(release, Intended())
    assert failing == [] and "vLLM's default" in words and "not given" in words
    assert {r["key"] for r in rows if r["verdict"] == "may apply"} == may
    _, _, failing = judge_defects(release, Intended("v1", True, "mtp"))
    assert set(failing) == strict
    _, _, failing = judge_defects(release, Intended("v1", False, "mtp"))
    assert failing == []
    _, rows, _ = judge_defects(release, Intended(None, None, "none"))
    assert not {r["key"] for r in rows if r["verdict"] == "applies"}
