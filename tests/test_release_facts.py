"""Every fact the release table states about a split body is what the installed
code gives.

A table row is found by the fingerprint of vLLM's split, so the row's facts must
be those its code shows, whichever releases share it: adding a release to a row
(0.27.0 to 0.27.1's) must change nothing. The code is read from vLLM's file on
disk, not through the imported class, which a plugin may have patched.
"""

from __future__ import annotations

import ast

from helpers import installed_body

from vllm_mamba_align import batch_invariance, releases, unverified
from vllm_mamba_align.fingerprint import CodeShape, analyse_source, method_in_file
from vllm_mamba_align.tools import installed


def _installed_split_shape() -> CodeShape:
    import vllm.v1.core.sched.scheduler as module

    node = method_in_file(module.__file__, "Scheduler", "_mamba_block_aligned_split")
    assert node is not None, "vLLM's scheduler has no split"
    return analyse_source(ast.unparse(node))


def test_the_table_row_states_the_split_facts_of_the_installed_code() -> None:
    shape = _installed_split_shape()
    body = installed_body()
    assert shape.fingerprint == body.fingerprint
    assert body.stops_after_mid_block_start == unverified.stops_after_mid_block_start(
        shape
    )
    assert body.aligns_drafter_tail == unverified.aligns_drafter_tail(shape)


def test_code_read_as_unverified_gets_the_rows_facts() -> None:
    """The opt-in for unverified code reads the same facts from the same code."""
    shape = _installed_split_shape()
    body = installed_body()
    drafted = unverified.unverified_body(shape)
    for name in (
        "prefill",
        "internal_checkpoint",
        "wide_block_exemption",
        "extra_parameter",
        "stops_after_mid_block_start",
        "aligns_drafter_tail",
        "checkpoint_write_stride",
        "checkpoint_blocks_unalign",
        "drops_mid_block_stop",
    ):
        assert getattr(drafted, name) == getattr(body, name), name


def test_the_checkpoint_backends_read_from_the_layers_are_the_releases() -> None:
    """Which backends declare prefill checkpoint blocks is read from the
    installed layer files; on a release it must be the backends that release
    first shipped with (CHECKPOINT_BACKENDS_SINCE, read off each wheel), and a
    body with no internal checkpointing has none to use."""
    from packaging.version import Version

    found = installed.checkpoint_backends_in(releases.vllm_package_dir())
    version = releases.installed_version()
    if version in releases.SUPPORTED_RELEASES:
        assert found == tuple(
            backend
            for backend, since in releases.CHECKPOINT_BACKENDS_SINCE.items()
            if Version(version) >= Version(since)
        )
    if installed_body().internal_checkpoint is releases.InternalCheckpoint.NONE:
        assert found == ()
    else:
        assert "flashkda" in found


def test_where_the_worker_checks_the_mamba_groups_is_the_tables() -> None:
    """The refusal of disagreeing Mamba groups states, from the release table,
    where vLLM's own worker stops such a model before the scheduler exists
    (Model Runner V2's ``initialize_kv_cache`` binding the groups, whose
    ``_get_mamba_group_info`` asserts one block size) and which releases still
    ship Model Runner V1 (which checks at its first step). Read from the
    installed files."""
    from packaging.version import Version

    root = releases.vllm_package_dir()
    assert root is not None
    version = Version(Version(releases.installed_version() or "0").base_version)
    init = None
    worker = root / releases.WORKER_FILE
    if worker.exists():
        init = method_in_file(str(worker), releases.MODEL_STATE, "initialize_kv_cache")
    binds_at_start = init is not None and any(
        isinstance(node, ast.Attribute) and node.attr == releases.GROUP_INFO_METHOD
        for node in ast.walk(init)
    )
    since = Version(releases.WORKER_CHECKS_GROUPS_AT_START_SINCE)
    assert binds_at_start == (version >= since)
    has_v1 = (root / "v1" / "worker" / "gpu_model_runner.py").exists()
    assert has_v1 == (version < Version(releases.V1_RUNNER_REMOVED_IN))


def test_what_the_installed_code_says_is_the_release_facts_row() -> None:
    """Each reading of the installed vLLM's code (batch_invariance.py,
    tools/installed.py) answers as the release-fact row says of the installed
    release, so a docstring or message that names the row's releases names
    where the code behaves so."""
    import pytest

    version = releases.installed_version()
    if version not in releases.SUPPORTED_RELEASES:
        pytest.skip(f"vLLM {version} is no release of the table")
    root = releases.vllm_package_dir()
    assert root is not None
    selector = (root / batch_invariance.SELECTOR_FILE).read_text()
    readings = [
        (
            "SELECTOR_ASKS_BATCH_INVARIANCE",
            batch_invariance.refuses_batch_invariance_for_mamba(),
        ),
        ("SELECTOR_TAKES_BACKEND_ENUM", "MAMBA_TYPE_TO_BACKEND_MAP" not in selector),
        ("REQUEST_NEEDS_EOS_TOKEN_ID", installed.requests_need_eos_token_id()),
        ("HASH_BLOCK_CHOSEN", installed.supports_hash_block()),
        ("RETENTION_IN_KV_CONFIG", installed.retention_in_kv_config()),
        ("LOOKAHEAD_HASHES", installed.supports_lookahead_hashes()),
        ("MODEL_RUNNER_V1", (root / "v1" / "worker" / "gpu_model_runner.py").exists()),
    ]
    readings += _retention_readings()
    for name, read in readings:
        fact = getattr(releases, name)
        assert read == fact.holds(version), f"{name}: read {read} on {version}"


def _retention_readings() -> list[tuple[str, bool]]:
    """What retention.read_retention reads off a built scheduler's coordinator
    and Mamba manager, one reading per row it stands for."""
    from helpers import cache_block_for

    from vllm_mamba_align.checkpoints import (
        installed_manager_skips_scratch_move,
        manager_rekeys_checkpoint_block,
    )
    from vllm_mamba_align.retention import mamba_manager, masks_by_retention
    from vllm_mamba_align.tools.sim import Geometry, Simulation

    state_block = 1648
    sim = Simulation(
        Geometry(cache_block=cache_block_for(state_block), state_block=state_block)
    )
    coordinator = sim.scheduler.kv_cache_manager.coordinator
    manager = mamba_manager(coordinator)
    assert manager is not None
    module = __import__(type(coordinator).__module__, fromlist=["replay_boundaries"])
    function = callable(getattr(module, "replay_boundaries", None))
    method = callable(getattr(coordinator, "get_replay_boundaries", None))
    return [
        (
            "RETENTION_FOR_MAMBA",
            hasattr(coordinator, "retention_interval")
            and masks_by_retention(type(manager)),
        ),
        ("HIT_ALIGNMENT", hasattr(manager, "cache_hit_alignment_tokens")),
        ("EAGLE_REPLAY_PAIR", method or function),
        ("REPLAY_BOUNDARIES_FUNCTION", function),
        ("EAGLE_JUNCTION_BLOCK", hasattr(coordinator, "drop_eagle_group_ids")),
        ("MANAGER_LEAVES_SCRATCH", installed_manager_skips_scratch_move()),
        ("MANAGER_REKEYS_CHECKPOINT", manager_rekeys_checkpoint_block(type(manager))),
    ]
