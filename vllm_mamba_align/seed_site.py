"""Which Model Runner V2 seed the installed vLLM ships, read from its worker
file without importing it (GPU code), for the start line.

Apart from the re-seed itself (worker_seed.py), which only a process that
imports vLLM's worker module loads: a scheduler's process reads the seed's
site for its start line but never runs it.
"""

from __future__ import annotations

import functools
from pathlib import Path

from .fingerprint import fingerprint_node, method_in_file
from .releases import (
    GROUP_INFO_METHOD,
    MODEL_STATE,
    SEED_METHOD,
    WORKER_FILE,
    SeedCode,
    SeedSite,
    classify_seed,
    seed_code,
    vllm_package_dir,
)

RESEEDED = (SeedSite.SEEDS_WITH_CACHE_BLOCK, SeedSite.SEEDS_WITH_MAMBA_BLOCK)
"""The seed sites the plugin re-seeds with B (every mode but ``off``)."""


@functools.cache
def site_in_file(path: Path) -> tuple[SeedSite, SeedCode | None]:
    """The seed site of a worker module's source file, read without importing
    it (GPU code), by the fingerprints the plugin patches by."""
    if not path.exists():
        return SeedSite.ABSENT, None
    try:
        seed = method_in_file(str(path), MODEL_STATE, SEED_METHOD)
        group_info = method_in_file(str(path), MODEL_STATE, GROUP_INFO_METHOD)
    except (OSError, SyntaxError, ValueError):
        return SeedSite.UNRECOGNIZED, None
    fingerprint = fingerprint_node(seed) if seed else None
    site = classify_seed(
        fingerprint,
        fingerprint_node(group_info) if group_info else None,
        present=seed is not None,
    )
    return site, seed_code(fingerprint)


def seed_grid(fixing: bool) -> str | None:
    """For the start line: which grid Model Runner V2's seed lands on, read from
    the installed worker file (the engine core does not import it); None where
    this vLLM has no such seed. ``fixing``: the mode is not ``off``."""
    root = vllm_package_dir()
    if root is None:
        return None
    site, code = site_in_file(root / WORKER_FILE)
    if site not in RESEEDED or code is None:
        return None
    if fixing:
        return f"worker seed on B (the plugin re-seeds vLLM's {code.divisor} seed)"
    return f"worker seed on vLLM's {code.divisor} (not B where it differs)"
