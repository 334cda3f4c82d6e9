"""doctor's decisions that need no vLLM: the plugin-loading rule and the worker
seed, classified from a source file with the plugin's fingerprints."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from vllm_mamba_align import doctor, releases, retention
from vllm_mamba_align.doctor import worker_seed_status, would_load
from vllm_mamba_align.fingerprint import fingerprint_source
from vllm_mamba_align.releases import SeedCode, SeedSite
from vllm_mamba_align.tools import retention_report


@pytest.mark.parametrize(
    ("value", "loads"),
    [
        (None, True),
        ("mamba_align", True),
        ("a,mamba_align", True),
        ("", False),
        ("a, mamba_align", False),  # vLLM does not strip spaces
        ("other", False),
    ],
)
def test_vllm_plugins_rule(value: str | None, loads: bool) -> None:
    assert would_load(value)[0] is loads


SEED = """
def add_request(self, req_index, new_req_data):
    if self._align_mode:
        self._mamba_state_idx_gpu[req_index].fill_(
            (new_req_data.num_computed_tokens - 1) // self.cache_config.block_size
        )
"""
GROUP_INFO = """
def _get_mamba_group_info(self, kv_cache_config):
    self._mamba_spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    return [0], self._mamba_spec
"""


def write_worker(root: Path, *methods: str) -> None:
    path = root / releases.WORKER_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    body = "".join(textwrap.indent(m, "    ") for m in methods)
    path.write_text(f"import torch\n\nclass {releases.MODEL_STATE}:\n{body}")


@pytest.fixture
def known_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend SEED and GROUP_INFO are a release's code that needs the fix."""
    code = SeedCode("9.9.9", fingerprint_source(SEED), SeedSite.SEEDS_WITH_CACHE_BLOCK)
    monkeypatch.setattr(releases, "_SEED_BY_FINGERPRINT", {code.fingerprint: code})
    monkeypatch.setattr(
        releases, "GROUP_INFO_BODIES", {fingerprint_source(GROUP_INFO): "9.9.9"}
    )


def test_a_seed_the_plugin_fixes_is_reported_patched(
    tmp_path: Path, known_seed: None
) -> None:
    write_worker(tmp_path, SEED, GROUP_INFO)
    status, detail = worker_seed_status(tmp_path, "full")
    assert status == "patched"
    assert detail.startswith(
        "patched by the plugin: vLLM 9.9.9's code seeds with cache_config.block_size"
    )
    assert worker_seed_status(tmp_path, "off")[0] == "affected"
    assert worker_seed_status(tmp_path, None)[0] == "affected"  # invalid mode


def test_a_mamba_block_seed_names_the_scaled_grid(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """0.32.0+'s seed divides by mamba_block_size: doctor names when that is
    not B (a hidden-state layer larger than the common page) and says the
    plugin re-seeds, instead of "not needed"."""
    seed = SEED.replace("cache_config.block_size", "cache_config.mamba_block_size")
    code = SeedCode("9.9.9", fingerprint_source(seed), SeedSite.SEEDS_WITH_MAMBA_BLOCK)
    monkeypatch.setattr(releases, "_SEED_BY_FINGERPRINT", {code.fingerprint: code})
    monkeypatch.setattr(
        releases, "GROUP_INFO_BODIES", {fingerprint_source(GROUP_INFO): "9.9.9"}
    )
    write_worker(tmp_path, seed, GROUP_INFO)
    status, detail = worker_seed_status(tmp_path, "lean")
    assert status == "patched"
    assert "seeds with cache_config.mamba_block_size" in detail
    assert "hidden-state layer (extract_hidden_states)" in detail
    assert "larger per token than the common page" in detail
    assert detail.endswith("re-seeds with the Mamba spec's block size (B)")
    status, detail = worker_seed_status(tmp_path, "off")
    assert status == "affected" and "not patched in this mode" in detail


def test_an_edited_seed_is_unrecognized(tmp_path: Path, known_seed: None) -> None:
    write_worker(tmp_path, SEED.replace("- 1", "- 2"), GROUP_INFO)
    status, detail = worker_seed_status(tmp_path, "full")
    assert status == "unknown"
    assert "unrecognized MambaHybridModelState.add_request" in detail


def test_no_model_runner_v2(tmp_path: Path) -> None:
    assert worker_seed_status(tmp_path, "full")[0] == "absent"
    write_worker(tmp_path, GROUP_INFO)  # the class without add_request
    assert worker_seed_status(tmp_path, "full")[0] == "absent"


@pytest.mark.parametrize(
    ("setting", "said"),
    [
        (
            (True, 0, retention.RETENTION_VARIABLE),
            f"0 ({retention.RETENTION_VARIABLE}=0)",
        ),
        (
            (True, 0, "--prefix-cache-retention-interval"),
            "0 (--prefix-cache-retention-interval, vLLM's default)",
        ),
        ((True, None, retention.RETENTION_VARIABLE), "dense ("),
    ],
)
def test_doctor_calls_a_retention_the_default_only_where_it_is(
    setting: tuple[bool, int | None, str],
    said: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """0.24.0-0.28.0 keep every state unless the variable is set: 0 there is
    the user's setting; 0.29.0+ default to 0."""
    monkeypatch.setattr(retention_report, "installed_setting", lambda: setting)
    text, _ = doctor._retention()
    assert text.startswith(said)


def test_this_tier_runs_without_vllm() -> None:
    """In the `unit` nox session vLLM is not even installed."""
    import importlib.util
    import os

    if os.environ.get("MAMBA_ALIGN_UNIT_ONLY") != "1":
        pytest.skip("only meaningful in the unit session's environment")
    assert importlib.util.find_spec("vllm") is None
