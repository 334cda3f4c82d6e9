"""vLLM's own defects that can still corrupt a hybrid model's output in align mode
with the plugin active: the one table doctor, the start line and the manual's
page (docs/defects.md, generated from :data:`DEFECTS`) read.

The plugin guarantees that no Mamba state is published under a wrong hash by
the split. These rows are what it does not fix: worker and kernel code, and
decode-time cache updates. A row is *confirmed* only where its code was read
in the release's wheel; each citation names the file and line and a piece of
the line (``needle``) that tests/test_defects.py finds there on the installed
release. Rows read nowhere are listed as reported upstream, never claimed.

Loaded by doctor, by the manual's generator, and at a scheduler's start only
when a drafter or async scheduling is configured (hazard.py), never per step.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

READ_RELEASES = ("0.27.1", "0.29.0", "0.33.0", "0.34.0")
"""The releases whose wheels the confirmed rows were read in."""

V1, V2 = "v1", "v2"
"""Model Runner V1 (``gpu_model_runner.py``) and V2 (``v1/worker/gpu/``)."""

RUNNER_VARIABLE = "VLLM_USE_V2_MODEL_RUNNER"
V2_DEFAULT_SINCE = Version("0.29.0")
"""From this release vLLM runs Model Runner V2 unless told otherwise."""
V1_REMOVED_IN = Version("0.34.0")
"""This release has no Model Runner V1."""


@dataclass(frozen=True)
class Citation:
    """Where a release's code shows a row's mechanism: ``file`` under ``vllm/``,
    ``line`` (1-based), ``needle`` a piece of that line. ``line`` 0: the file
    is absent from the release (the mechanism is not there)."""

    file: str
    line: int
    needle: str = ""

    def __str__(self) -> str:
        if self.line == 0:
            return f"`{self.file}` absent"
        return f"`{self.file}:{self.line}`"


class Verdict(enum.Enum):
    APPLIES = "applies"
    MAY_APPLY = "may apply"
    DOES_NOT_APPLY = "does not apply"
    NOT_READ = "not read for this release"
    REPORTED = "reported upstream, not confirmed here"


@dataclass(frozen=True)
class Defect:
    """One row of the page."""

    key: str
    """The upstream number (issue or pull request) the row is known by."""
    title: str
    upstream: str
    mechanism: str
    releases: str
    """A PEP 440 specifier: the releases whose code has the mechanism (within
    the read ones: :data:`READ_RELEASES`); empty where not confirmed."""
    evidence: dict[str, tuple[Citation, ...]]
    """Release -> the citations read in its wheel."""
    triggers: str
    plugin: str
    """What the plugin does to it (fixes / does not touch / more or less likely)."""
    avoid: str
    """The setting that avoids it, or why none does."""
    runner: str | None = None
    """``v1``/``v2``: only that runner has it; None: any."""
    needs_async: bool = False
    needs_drafter: bool = False
    unknowable: str = ""
    """A trigger doctor cannot see (the workload, the model's layers): with
    it, a row whose settings all match only *may* apply."""
    corrupts: bool = True
    """Known to corrupt output (or crash) once triggered."""
    strict: bool = False
    """``doctor --strict`` fails and the start line warns when it applies:
    known to corrupt output, and a serving setting avoids it."""
    confirmed: bool = True
    """Read in code (or measured); False: reported upstream, not confirmed here."""
    measured: str = ""
    """The test that measures it, for a row shown by behaviour, not a line."""

    def assess(self, setting: Setting) -> Verdict:
        """Whether this row applies to ``setting`` (None fields: not known)."""
        if not self.confirmed:
            return Verdict.REPORTED
        if not covers(setting.release):
            return Verdict.NOT_READ
        release = _version(setting.release)
        if release is None or not SpecifierSet(self.releases).contains(
            release, prereleases=True
        ):
            return Verdict.DOES_NOT_APPLY
        known = [
            _match(
                self.runner is None or setting.runner == self.runner, setting.runner
            ),
            _match(
                not self.needs_async or bool(setting.async_scheduling),
                setting.async_scheduling,
            ),
            _match(not self.needs_drafter or bool(setting.drafter), setting.drafter),
        ]
        if False in known:
            return Verdict.DOES_NOT_APPLY
        if None in known or self.unknowable:
            return Verdict.MAY_APPLY
        return Verdict.APPLIES


def _match(holds: bool, value: object) -> bool | None:
    """True/False where the setting is known, None where it is not."""
    if value is None:
        return None if not holds else True
    return holds


@dataclass(frozen=True)
class Setting:
    """What a deployment runs: the release and the serve settings (None: not
    known, e.g. doctor was not told)."""

    release: str | None
    runner: str | None = None
    async_scheduling: bool | None = None
    drafter: str | None = None
    """The speculative method (``mtp``, ``eagle3``, ``ngram`` …); "" for none."""


def _version(release: str | None) -> Version | None:
    try:
        return Version(release) if release else None
    except InvalidVersion:
        return None


def _within_read(release: Version) -> bool:
    """Whether ``release`` lies within the read releases' span (a release
    between two read ones is judged by the row's specifier)."""
    first, last = Version(READ_RELEASES[0]), Version(READ_RELEASES[-1])
    return first <= Version(release.base_version) <= last


def covers(release: str | None) -> bool:
    """Whether the table has read ``release``'s span (between the first and
    the last of :data:`READ_RELEASES`): outside it every confirmed row says
    "not read for this release"."""
    version = _version(release)
    return version is not None and _within_read(version)


def default_runner(release: str | None, variable: str | None) -> str | None:
    """The runner vLLM picks for a hybrid model, from the release and
    ``VLLM_USE_V2_MODEL_RUNNER`` (None: cannot tell)."""
    version = _version(release)
    if version is None:
        return None
    if version >= V1_REMOVED_IN:
        return V2
    value = (variable or "").strip().lower()
    if value in ("1", "true"):
        return V2
    if value in ("0", "false"):
        return V1
    return V2 if version >= V2_DEFAULT_SINCE else V1


def assess(setting: Setting) -> list[tuple[Defect, Verdict]]:
    """Every row with its verdict for ``setting``, the table's order."""
    return [(defect, defect.assess(setting)) for defect in DEFECTS]


def strict_failures(setting: Setting) -> list[Defect]:
    """The rows ``doctor --strict`` fails on: known to corrupt, avoidable by
    a setting, and applying to every setting given."""
    return [d for d, v in assess(setting) if d.strict and v is Verdict.APPLIES]


def start_warning(defect: Defect) -> str:
    """The start line's warning about a strict row that applies."""
    return (
        f"vllm-mamba-align: vLLM defect {defect.key} ({defect.title}) can corrupt "
        f"this engine's output: {defect.triggers}. The plugin {defect.plugin}. "
        f"Avoid it: {defect.avoid}. (The manual: 'What vLLM still gets wrong'.)"
    )


MEASURED_57605 = (
    "ends more chunks exactly on B boundaries with lookahead after them than "
    "stock (C < B), and keeps those ends: measured on the real scheduler of "
    "0.33.0 and 0.34.0 with vLLM's own worker rule (tests/test_lookahead_"
    "boundaries.py, the witness judging), no published or read state comes "
    "from a stale block, in stock or any fixing mode"
)
"""What tests/test_lookahead_boundaries.py measures on the real scheduler."""


def _cite(**by_release: Sequence[Citation]) -> dict[str, tuple[Citation, ...]]:
    return {r.lstrip("v").replace("_", "."): tuple(c) for r, c in by_release.items()}


GPU_RUNNER = "v1/worker/gpu_model_runner.py"
INPUT_BATCH = "v1/worker/gpu_input_batch.py"
MANAGERS = "v1/core/single_type_kv_cache_manager.py"
INTERFACE = "v1/kv_cache_interface.py"
FLA = "third_party/flash_linear_attention/ops"

DEFECTS: tuple[Defect, ...] = (
    Defect(
        key="#51571",
        title="async drafting reads accepted-token counts from reordered rows",
        upstream="vLLM issue #51571 (open; fix PRs #51599, #53919 open)",
        mechanism=(
            "Model Runner V1 copies step N's accepted-token counts into the "
            "input batch's rows; before step N+1 reads them back through the "
            "previous positions, it condenses (reorders) those rows, so a "
            "request can take another's count as its state offset, run from "
            "the wrong Mamba state and write that state back, to be cached"
        ),
        releases=">=0.27.1,<0.34.0",
        evidence=_cite(
            v0_27_1=(
                Citation(
                    GPU_RUNNER, 1598, "self.input_batch.num_accepted_tokens_cpu_tensor"
                ),
                Citation(GPU_RUNNER, 2112, 'mamba_cache_mode != "align"'),
                Citation(GPU_RUNNER, 2122, "self.input_batch.num_accepted_tokens_cpu["),
                Citation(
                    INPUT_BATCH, 815, "self.num_accepted_tokens_cpu[empty_index] ="
                ),
            ),
            v0_29_0=(
                Citation(
                    GPU_RUNNER, 1608, "self.input_batch.num_accepted_tokens_cpu_tensor"
                ),
                Citation(GPU_RUNNER, 2128, 'mamba_cache_mode != "align"'),
                Citation(GPU_RUNNER, 2138, "self.input_batch.num_accepted_tokens_cpu["),
                Citation(
                    INPUT_BATCH, 813, "self.num_accepted_tokens_cpu[empty_index] ="
                ),
            ),
            v0_33_0=(
                Citation(
                    GPU_RUNNER, 1578, "self.input_batch.num_accepted_tokens_cpu_tensor"
                ),
                Citation(GPU_RUNNER, 2072, 'mamba_cache_mode != "align"'),
                Citation(GPU_RUNNER, 2082, "self.input_batch.num_accepted_tokens_cpu["),
                Citation(
                    INPUT_BATCH, 806, "self.num_accepted_tokens_cpu[empty_index] ="
                ),
            ),
            v0_34_0=(Citation(GPU_RUNNER, 0),),
        ),
        triggers=(
            "Model Runner V1, async scheduling and a drafter (MTP, EAGLE, any "
            "speculative method) on a hybrid model in align mode"
        ),
        plugin="does not touch it: worker code, outside the split",
        avoid=(
            "`--no-async-scheduling`; on 0.29.0-0.33.0 also Model Runner V2 "
            f"(leave {RUNNER_VARIABLE} unset, serve no feature V2 lacks)"
        ),
        runner=V1,
        needs_async=True,
        needs_drafter=True,
        unknowable="",
        strict=True,
    ),
    Defect(
        key="#50021",
        title="GDN/KDA drafting kernels index the state table unbounded",
        upstream="vLLM pull request #50021 (open)",
        mechanism=(
            "the GDN recurrent kernels read a draft row's initial state at "
            "column `num_accepted_tokens - 1` of its state-index row without "
            "a bound: a count of 0 (or above 1 + k) reads outside the row, a "
            "crash where the address is unmapped, another slot's state where "
            "it is mapped"
        ),
        releases=">=0.27.1",
        evidence=_cite(
            v0_27_1=(
                Citation(
                    f"{FLA}/fused_recurrent.py",
                    106,
                    "tl.load(num_accepted_tokens + i_n)",
                ),
                Citation(
                    f"{FLA}/fused_sigmoid_gating.py",
                    106,
                    "tl.load(num_accepted_tokens + i_n)",
                ),
            ),
            v0_29_0=(
                Citation(
                    f"{FLA}/fused_recurrent.py",
                    106,
                    "tl.load(num_accepted_tokens + i_n)",
                ),
                Citation(
                    f"{FLA}/fused_sigmoid_gating.py",
                    106,
                    "tl.load(num_accepted_tokens + i_n)",
                ),
            ),
            v0_33_0=(
                Citation(
                    f"{FLA}/fused_recurrent.py",
                    107,
                    "tl.load(num_accepted_tokens + i_n)",
                ),
                Citation(
                    f"{FLA}/fused_recurrent.py",
                    111,
                    "ssm_state_indices + i_n * stride_indices_seq + i_t",
                ),
                Citation(
                    f"{FLA}/fused_sigmoid_gating.py",
                    106,
                    "tl.load(num_accepted_tokens + i_n)",
                ),
                Citation(
                    f"{FLA}/fused_sigmoid_gating.py",
                    110,
                    "ssm_state_indices + i_n * stride_indices_seq + i_t",
                ),
            ),
            v0_34_0=(
                Citation(
                    f"{FLA}/fused_recurrent.py",
                    107,
                    "tl.load(num_accepted_tokens + i_n)",
                ),
                Citation(
                    f"{FLA}/fused_sigmoid_gating.py",
                    106,
                    "tl.load(num_accepted_tokens + i_n)",
                ),
            ),
        ),
        triggers=(
            "a GDN model (Qwen3-Next, Qwen3.5) with a drafter, once an "
            "out-of-range accepted count reaches the kernel (upstream reports "
            "one from a discarded async step)"
        ),
        plugin="does not touch it: kernel code, outside the split",
        avoid=(
            "none while drafting on a GDN model (the kernel takes the count "
            "unchecked); without a drafter the path is not taken"
        ),
        needs_drafter=True,
        unknowable="the model's layers (GDN/KDA) and an out-of-range count",
    ),
    Defect(
        key="#50729",
        title="drafting's conv-state shift within one block is unordered",
        upstream="vLLM pull request #50729 (merged, in 0.29.0)",
        mechanism=(
            "after a verify step whose accepted tokens stay in the running "
            "block, the fused copy shifts the conv window left within that "
            "same block by parallel loads and stores, which do not order the "
            "overlapping bytes: the window can mix old and new tokens"
        ),
        releases=">=0.27.1,<0.29.0",
        evidence=_cite(
            v0_27_1=(
                Citation("v1/worker/mamba_utils.py", 104, "# SD conv: copy"),
                Citation(
                    "v1/worker/mamba_utils.py",
                    258,
                    "if src_block_idx == dest_block_idx and accept_token_bias == 0:",
                ),
            ),
            v0_29_0=(
                Citation(
                    "v1/worker/mamba_utils.py",
                    321,
                    "if src_block_id != dest_block_id or token_bias == 0:",
                ),
            ),
        ),
        triggers=(
            "a drafter on a model with conv states (Mamba2, GDN) in align "
            "mode, GPU timing (a race)"
        ),
        plugin="does not touch it: worker code, outside the split",
        avoid=(
            "vLLM 0.29.0 or later (copies token by token); or serve without a drafter"
        ),
        needs_drafter=True,
        unknowable="GPU thread timing",
    ),
    Defect(
        key="async tail",
        title="async scheduling republishes a prompt's partial-tail state",
        upstream="found by this project's tests (no upstream report)",
        mechanism=(
            "with the prompt's sampled token still in flight, the first decode "
            "step caches the request up to the prompt's end again, which "
            "registers the partial-tail state's hash on the running block that "
            "step then overwrites"
        ),
        releases=">=0.26.0,<0.32.0",
        evidence={},
        measured=(
            "tests/test_async.py::test_vllm_own_async_defect_is_the_only_wrong_"
            "publication, stock and `full` alike (0.26.0-0.31.0; not 0.32.0+)"
        ),
        triggers=(
            "async scheduling and a prompt ending on a hash block inside a "
            "state block (hash block < B)"
        ),
        plugin=(
            "does not fix it (a decode-time cache update): the same wrong "
            "publication in stock and every mode"
        ),
        avoid="`--no-async-scheduling`",
        needs_async=True,
        unknowable="the geometry (hash block < B) and the prompt's length",
    ),
    Defect(
        key="#56524",
        title="Mamba blocks are never zeroed when allocated",
        upstream="vLLM pull request #56524 (open)",
        mechanism=(
            "the KV-cache config asks for new blocks to be zeroed because "
            "Mamba states are read before written, but only attention managers "
            "record their new blocks for zeroing: a read of a Mamba slot its "
            "request never wrote returns the previous tenant's state"
        ),
        releases=">=0.27.1",
        evidence=_cite(
            v0_27_1=(
                Citation(
                    MANAGERS,
                    86,
                    "self._record_new_block_ids = needs_kv_cache_zeroing and type(",
                ),
                Citation(INTERFACE, 1022, "return self.has_mamba_layers or"),
            ),
            v0_29_0=(
                Citation(MANAGERS, 92, "and isinstance(kv_cache_spec, AttentionSpec)"),
                Citation(INTERFACE, 1293, "return self.has_mamba_layers or"),
            ),
            v0_33_0=(
                Citation(MANAGERS, 118, "and isinstance(kv_cache_spec, AttentionSpec)"),
                Citation(INTERFACE, 1660, "return self.has_mamba_layers or"),
            ),
            v0_34_0=(
                Citation(MANAGERS, 119, "and isinstance(kv_cache_spec, AttentionSpec)"),
                Citation(INTERFACE, 1604, "self.has_mamba_layers or"),
            ),
        ),
        triggers=(
            "any read of a Mamba slot before its request wrote it (another "
            "defect's wrong column); harmless alone"
        ),
        plugin=(
            "does not zero blocks; its modes read no unwritten slot in the "
            "witness's workloads (tests/witness)"
        ),
        avoid=(
            "none (it turns another defect's wrong read into another request's state)"
        ),
        unknowable="a wrong-slot read elsewhere",
        corrupts=False,
    ),
    Defect(
        key="#57605",
        title="align allocation ignores lookahead tokens at a block's end",
        upstream="vLLM pull request #57605 (open)",
        mechanism=(
            "in align mode the Mamba manager sizes a request's blocks by the "
            "main model's tokens alone, so a chunk ending exactly on a B "
            "boundary with lookahead tokens after it gets no block past the "
            "boundary; the report says the boundary state then lands in a "
            "stale block"
        ),
        releases="",
        evidence=_cite(
            v0_33_0=(Citation(MANAGERS, 1736, "num_tokens = num_tokens_main_model"),),
            v0_34_0=(Citation(MANAGERS, 1741, "num_tokens = num_tokens_main_model"),),
        ),
        triggers="a drafter, a chunk ending exactly on a B boundary",
        plugin=MEASURED_57605,
        avoid="none needed with vLLM's own worker (see the measurement)",
        needs_drafter=True,
        confirmed=False,
    ),
    Defect(
        key="#53912",
        title="prefix caching with MTP corrupts hybrid output (0.28.0)",
        upstream="vLLM issue #53912 (open; cause not established)",
        mechanism="not established upstream",
        releases="",
        evidence={},
        triggers="prefix caching and MTP on a hybrid model",
        plugin="unknown (no mechanism to check)",
        avoid="unknown",
        needs_drafter=True,
        confirmed=False,
    ),
    Defect(
        key="#35288",
        title="MTP output garbled with several decodes in a batch",
        upstream="vLLM issue #35288 (open)",
        mechanism="not established here",
        releases="",
        evidence={},
        triggers="MTP with several decoding requests in one batch",
        plugin="unknown (no mechanism to check)",
        avoid="unknown",
        needs_drafter=True,
        confirmed=False,
    ),
)
"""The table, in the page's order."""
