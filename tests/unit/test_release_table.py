"""The release table is consistent with itself and with the tested environments."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import CacheBlockRule, cache_block_rule
from packaging.version import Version

from vllm_mamba_align import batch_invariance, releases
from vllm_mamba_align.releases import (
    BODIES,
    SEED_BODIES,
    SUPPORTED_RELEASES,
    CheckpointGrid,
    InternalCheckpoint,
    PrefillRule,
    SeedSite,
    body_for,
    classify_seed,
    expected_body,
    in_prefill,
)
from vllm_mamba_align.tools.installed import (
    CHECKPOINT_BACKEND_FILES,
    checkpoint_backends_in,
)

ENVS = Path(__file__).resolve().parents[2] / "envs"
HEX16 = re.compile(r"[0-9a-f]{16}")


def test_every_body_has_its_own_fingerprint_and_releases() -> None:
    fingerprints = [body.fingerprint for body in BODIES]
    assert len(set(fingerprints)) == len(fingerprints) == 15  # 11 released
    assert all(HEX16.fullmatch(f) for f in fingerprints)
    shipped = [r for body in BODIES for r in body.releases]
    assert len(set(shipped)) == len(shipped), "a release listed twice"
    assert shipped == sorted(shipped, key=Version), "bodies in release order"
    for body in BODIES:
        assert body_for(body.fingerprint) is body
        for release in body.releases:
            assert expected_body(release) is body
            assert expected_body(f"{release}+cpu") is body


def test_every_pinned_environment_is_a_verified_release() -> None:
    pinned = {p.stem.removeprefix("vllm-") for p in ENVS.glob("vllm-*.txt")}
    assert pinned == set(SUPPORTED_RELEASES)


def test_every_nightly_only_body_has_one_pinned_build() -> None:
    """A body no release shipped names the nightly builds that carry it; one of
    them has a pinned environment (envs/nightly-<build>.txt), where the whole
    suite runs (``nox -s tests_nightly``)."""
    pinned = {p.stem.removeprefix("nightly-") for p in ENVS.glob("nightly-*.txt")}
    for body in BODIES:
        assert body.releases or body.nightlies, body.name
        assert all(Version(build).is_devrelease for build in body.nightlies)
        if not body.releases:
            assert len(pinned & set(body.nightlies)) == 1, body.name
            assert expected_body(body.nightlies[-1]) is body
    assert pinned <= {build for body in BODIES for build in body.nightlies}


def test_rules_change_where_the_domain_notes_say() -> None:
    by_release = {r: body for body in BODIES for r in body.releases}
    no_output = {
        r for r, b in by_release.items() if b.prefill is PrefillRule.NO_OUTPUT_YET
    }
    assert no_output == {"0.15.0", "0.15.1", "0.16.0"}
    wide = {r for r, b in by_release.items() if b.wide_block_exemption}
    assert min(wide, key=Version) == "0.27.0"
    assert all(Version(r) >= Version("0.27.0") for r in wide)
    extra = {r for r, b in by_release.items() if b.extra_parameter}
    assert extra == {"0.24.0", "0.25.0", "0.25.1"}
    assert {b.extra_parameter for b in BODIES} == {
        None,
        "num_uncached_common_prefix_tokens",
    }
    checkpoint = {r: b.internal_checkpoint for r, b in by_release.items()}
    assert checkpoint["0.28.0"] is InternalCheckpoint.NONE
    assert checkpoint["0.29.0"] is InternalCheckpoint.ALIGNED_START
    assert all(
        checkpoint[r] is InternalCheckpoint.OBSERVED
        for r in ("0.30.0", "0.31.0", "0.32.0", "0.33.0")
    )
    # Only OBSERVED bodies say where the backend writes its state.
    grids = {r: b.checkpoint_grid for r, b in by_release.items()}
    assert {r for r, g in grids.items() if g} == {
        r for r, c in checkpoint.items() if c is InternalCheckpoint.OBSERVED
    }
    assert grids["0.30.0"] is grids["0.31.0"] is CheckpointGrid.PREFIX_MATCH_UNIT
    assert grids["0.32.0"] is grids["0.33.0"] is CheckpointGrid.CACHE_HIT_ALIGNMENT


def test_checkpoint_backends_are_read_from_the_layer_files(tmp_path: Path) -> None:
    """A backend counts where its layer sets ``num_prefill_checkpoint_blocks``
    (keyword or assignment); naming the field is not declaring it."""
    files = CHECKPOINT_BACKEND_FILES
    assert checkpoint_backends_in(None) == checkpoint_backends_in(tmp_path) == ()
    kda = tmp_path / files["flashkda"]
    kda.parent.mkdir(parents=True)
    kda.write_text("spec = MambaSpec(num_prefill_checkpoint_blocks=1)\n")
    mixer = tmp_path / files["mamba2"]
    mixer.parent.mkdir(parents=True)
    mixer.write_text("if spec.num_prefill_checkpoint_blocks > 0:\n    pass\n")
    assert checkpoint_backends_in(tmp_path) == ("flashkda",)
    mixer.write_text("self.num_prefill_checkpoint_blocks = 1\n")
    assert checkpoint_backends_in(tmp_path) == ("flashkda", "mamba2")
    assert set(releases.CHECKPOINT_BACKENDS_SINCE) == set(files)


def test_the_release_notes_name_every_checkpoint_backend() -> None:
    """docs/releases.md names each backend with checkpoint blocks and its first
    release as ``CHECKPOINT_BACKENDS_SINCE`` has them (the names are the ones
    ``simulate --checkpoint-backend`` takes)."""
    notes = " ".join(
        (Path(__file__).parents[2] / "docs" / "releases.md").read_text().split()
    )
    for backend, since in releases.CHECKPOINT_BACKENDS_SINCE.items():
        assert f"`{backend}` {since}+" in notes, backend


def test_worker_seed_table() -> None:
    assert len({code.fingerprint for code in SEED_BODIES}) == len(SEED_BODIES)
    group_info = next(iter(releases.GROUP_INFO_BODIES))
    for code in SEED_BODIES:
        assert classify_seed(code.fingerprint, group_info) is code.site
    fix = [c for c in SEED_BODIES if c.site is SeedSite.SEEDS_WITH_CACHE_BLOCK]
    assert [c.releases for c in fix] == ["0.25.0-0.25.1", "0.26.0", "0.27.0-0.31.0"]
    # Without a recognized _get_mamba_group_info the deferred re-seed is not safe.
    assert classify_seed(fix[0].fingerprint, None) is SeedSite.UNRECOGNIZED
    assert classify_seed("0" * 16, group_info) is SeedSite.UNRECOGNIZED
    assert classify_seed(None, None, present=False) is SeedSite.ABSENT


@pytest.mark.parametrize(
    ("version", "rule"),
    [
        ("0.15.0", CacheBlockRule.DIVISOR),
        ("0.15.1", CacheBlockRule.DIVISOR),
        ("0.19.1", CacheBlockRule.DIVISOR),
        ("0.20.0", CacheBlockRule.EQUAL),
        ("0.20.2", CacheBlockRule.EQUAL),
        ("0.27.0", CacheBlockRule.EQUAL),
        ("0.27.1", CacheBlockRule.EQUAL),
        ("0.28.0", CacheBlockRule.ANY),
        ("0.33.0", CacheBlockRule.ANY),
        ("0.1.dev20073+g8e685d198", CacheBlockRule.EQUAL),
        ("dev", CacheBlockRule.EQUAL),
        (None, CacheBlockRule.EQUAL),
    ],
)
def test_which_cache_blocks_a_release_starts_with(
    version: str | None, rule: CacheBlockRule
) -> None:
    assert cache_block_rule(version) is rule


def request(prompt: int, tokens: int, outputs: int) -> SimpleNamespace:
    return SimpleNamespace(
        num_prompt_tokens=prompt, num_tokens=tokens, num_output_tokens=outputs
    )


def test_the_prefill_predicate_of_each_rule() -> None:
    fresh = request(prompt=100, tokens=100, outputs=0)
    resumed = request(prompt=100, tokens=140, outputs=40)  # replaying its outputs
    for rule in PrefillRule:
        assert in_prefill(rule, fresh, 0)
        assert in_prefill(rule, fresh, 99)
    assert not in_prefill(PrefillRule.BEFORE_PREFILL_END, fresh, 100)
    assert in_prefill(PrefillRule.BEFORE_PREFILL_END, resumed, 120)
    assert not in_prefill(PrefillRule.BEFORE_PREFILL_END, resumed, 139)
    # 0.15.1-0.16.0: a request with outputs is never prefill, replay or not.
    assert not in_prefill(PrefillRule.NO_OUTPUT_YET, resumed, 0)


SELECTORS = {
    "asks": "def _cached_get_mamba_attn_backend(kind):\n"
    "    backend = kind.get_class()\n"
    "    if envs.VLLM_BATCH_INVARIANT and not backend.supports_batch_invariance():\n"
    "        raise RuntimeError('not supported')\n"
    "    return backend\n",
    "asks elsewhere": "def get_attn_backend(kind):\n"
    "    return kind.supports_batch_invariance()\n\n"
    "def get_mamba_attn_backend(kind):\n    return kind.get_class()\n",
    "does not ask": "def get_mamba_attn_backend(kind):\n    return kind.get_class()\n",
}


@pytest.mark.parametrize(
    ("selector", "refuses"),
    [("asks", True), ("asks elsewhere", False), ("does not ask", False)],
)
def test_batch_invariance_refusal_is_read_from_the_mamba_selector(
    selector: str, refuses: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The answer comes from the selector's Mamba function, whatever the version
    says (the real selectors' answers: tests/test_default_mode.py)."""
    package = tmp_path / "vllm"
    (package / "v1" / "attention").mkdir(parents=True)
    (package / "__init__.py").write_text("__version__ = '0.1.dev1+g0000000'\n")
    (package / batch_invariance.SELECTOR_FILE).write_text(SELECTORS[selector])
    monkeypatch.setitem(
        sys.modules,
        "vllm",
        SimpleNamespace(__file__=str(package / "__init__.py")),
    )
    assert batch_invariance.refuses_batch_invariance_for_mamba() is refuses


def test_an_unreadable_selector_counts_as_refusing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The newest releases refuse: the likelier answer for code the
    plugin cannot read."""
    monkeypatch.setitem(
        sys.modules,
        "vllm",
        SimpleNamespace(__file__=str(tmp_path / "vllm" / "__init__.py")),
    )
    assert batch_invariance.refuses_batch_invariance_for_mamba() is True
