"""``vllm-mamba-align doctor``: does this deployment hit the defect; would we fix it?

Collects one :class:`Report` from the installed vLLM without starting an engine or
touching a GPU: vLLM's version, which known split body its code matches, every
layer of the split vLLM calls (other plugins' wrappers included), whether vLLM's
plugin loader would load this plugin, the mode, the Model Runner V2 worker's
state-seed site, and whether the upstream fix is already in vLLM.

Before it looks, it loads plugins the way vLLM does when it builds an engine
config: it resolves ``vllm.platforms.current_platform`` (vLLM's platform plugin
selection), loads the general plugins, and calls the platform's
``pre_register_and_update`` (where vllm-ascend applies its patches), so that
another plugin's patches are in place when the split is walked. A failure in any
of those steps is reported, not raised.

What the plugin would do is read from the plugin's own decision table
(:data:`activation.DECISION`, walked by :func:`activation.rows_walked` on
:func:`recognition.recognize`'s recognition), never a copy, so the doctor cannot
disagree with what happens at ``vllm serve``: each row the walk reads is reported
with whether it holds here, the rows that read the scheduler built for a model
as decided at start; the deciding row gives the verdict, and a refusing row its
error, in the plugin's words. Only the words for each row (:data:`ROW_WORDS`) are
the doctor's.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import platform
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from . import settings, topology
from .audit.export import export_status as metrics_export_status
from .batch_invariance import refuses_batch_invariance_for_mamba
from .errors import MambaAlignError
from .fingerprint import fingerprint_node, method_in_file
from .releases import (
    BATCH_INVARIANT_VARIABLE,
    CPU_WORKER_FILE,
    GROUP_INFO_METHOD,
    MODEL_STATE,
    SEED_METHOD,
    SUPPORTED_RELEASES,
    WORKER_FILE,
    SeedSite,
    classify_seed,
    describe_mismatch,
    describe_version,
    expected_body,
    seed_code,
    vllm_package_dir,
)
from .settings import Mode
from .version import __version__

PLUGIN_NAME = "mamba_align"
PLUGIN_GROUP = "vllm.general_plugins"


@dataclass(frozen=True)
class RowWords:
    """How the doctor reads one row of the decision table to an operator."""

    says: str
    """When the row holds (and, for a row that binds, which route)."""
    starts: str | None
    """How a hybrid model in align mode starts where the row decides
    ("... starts <starts>"); None for a refusing row (its error says it)."""


ROW_WORDS = {
    "no_align_split": RowWords(
        "the model has no Mamba layers in align mode", "unchanged"
    ),
    "upstream_fix": RowWords(
        "vLLM derives mamba_state_block_size itself (the upstream fix)", "unchanged"
    ),
    "no_mamba_spec": RowWords(
        "no Mamba spec among the model's KV-cache groups", "unchanged"
    ),
    "off": RowWords(f"{settings.MODE_VARIABLE}=off", "unchanged"),
    "disagreeing_groups": RowWords(
        "the model's Mamba groups disagree on their block size", None
    ),
    "unverified_layers": RowWords(
        "a layer of the split the plugin has not verified", None
    ),
    "unknown_code": RowWords(
        "vLLM's split matches no verified release (and the opt-in does not run it)",
        None,
    ),
    "foreign_subclass": RowWords(
        "the scheduler class is another distribution's subclass the fix cannot run in",
        None,
    ),
    "audit": RowWords(
        f"{settings.MODE_VARIABLE}=audit: the audit's observer around vLLM's split",
        "with the audit counting (stock vLLM scheduling)",
    ),
    "stall": RowWords(
        "B is wider than the step budget, on a split body that floors chunks to B",
        None,
    ),
    "as_vllm": RowWords(
        "the fix would schedule as vLLM's split does (C = B, no stop applies): "
        "vLLM's own split",
        "with the fix active",
    ),
    "fix": RowWords(
        "any other scheduler: the fix, the mode's route on the B grid",
        "with the fix active",
    ),
}
"""The doctor's words for each row of :data:`activation.DECISION`, by key."""


class VllmMissing(Exception):
    """vLLM cannot be imported in this environment (the doctor has nothing to read)."""


class BadSchedulerClass(Exception):
    """``--scheduler-cls`` names no class doctor can judge (the message says why)."""


def resolve_scheduler_class(name: str, vllm_scheduler_class: type) -> type:
    """The class ``--scheduler-cls`` names, as vLLM resolves its option of that
    name (``module.path.ClassName``), if it is a scheduler vLLM could build with
    the plugin's wrappers in it: a subclass of vLLM's ``Scheduler``."""
    module_name, _, class_name = name.rpartition(".")
    if not module_name or not class_name:
        raise BadSchedulerClass(
            f"--scheduler-cls {name!r} is not a dotted path module.ClassName "
            "(what vLLM's --scheduler-cls takes)"
        )
    try:
        klass = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as error:
        raise BadSchedulerClass(
            f"--scheduler-cls {name!r} cannot be imported here ({error}): run "
            "doctor in the Python that runs vLLM, with the package that defines "
            "the class installed"
        ) from None
    if not (isinstance(klass, type) and issubclass(klass, vllm_scheduler_class)):
        raise BadSchedulerClass(
            f"--scheduler-cls {name!r} is not a subclass of vLLM's Scheduler: the "
            "plugin's wrappers are not in it, so it runs no fix whatever doctor says"
        )
    return klass


@dataclass
class Report:
    """Everything the doctor found; ``--json`` prints it as is."""

    plugin_version: str
    python_version: str
    """The interpreter the doctor ran on (vLLM's official image runs 3.12)."""
    vllm_version: str | None
    vllm_location: str | None
    split_present: bool
    split_fingerprint: str | None
    split_body: str | None
    """The release(s) whose split body the installed code matches, if any."""
    split_verified: bool
    split_meaning: str
    platform: str | None
    """vLLM's current platform, resolved as vLLM resolves it (None: it failed)."""
    platform_detail: str
    """How the platform and plugins were loaded, and what failed."""
    split_layers: list[dict[str, str | None]]
    """Every layer of ``Scheduler._mamba_block_aligned_split``, outermost first:
    role (this plugin's wrapper, vLLM's own function, not verified), kind,
    module, qualname, location, distribution, where, order."""
    split_foreign: bool
    """Some layer is not verified: another plugin patched the split."""
    scheduler_class: str
    """The class judged: the one ``doctor --scheduler-cls`` names, else the one
    ``vllm.v1.core.sched.scheduler.Scheduler`` names, which vLLM builds unless
    ``scheduler_cls`` or async scheduling picks another: vLLM's own, or another
    distribution's subclass put in its place."""
    scheduler_class_note: str | None
    """That class, when it is another distribution's subclass: its module,
    distribution, and whether the fix can run in its code (None: vLLM's own)."""
    expected_fingerprint: str | None
    """What the release named by the version ships, when that release is known."""
    entry_point_visible: bool
    entry_point_target: str | None
    vllm_plugins: str | None
    """The current ``VLLM_PLUGINS`` value (None: unset)."""
    would_load: bool
    loading_note: str
    mode: str | None
    mode_error: str | None
    allow_unverified: bool
    worker_seed: str
    """``patched`` (by the plugin) / ``affected`` (not patched in this mode) /
    ``absent`` / ``unknown``."""
    worker_seed_detail: str
    upstream_fix_present: bool
    retention: str
    """The state retention a new engine runs with when the user sets nothing."""
    retention_by_mode: dict[str, str]
    """What each plugin mode does under that retention."""
    would_refuse: bool
    refusal: str | None
    """The exact error the plugin would raise for a hybrid align-mode model."""
    decision: list[dict[str, str]] = field(default_factory=list)
    """The rows of the plugin's decision table read for a hybrid model in align
    mode, first row first, up to the one that decides: row (its key), holds
    (yes / no / at start: read from the scheduler vLLM builds for a model),
    outcome, says (the row in words). Empty when a setting stops vLLM first."""
    decided_by: str | None = None
    """The key of the row that decides (None: a setting stops vLLM first)."""
    metrics_exported: bool = False
    """prometheus_client importable and PROMETHEUS_MULTIPROC_DIR set: the audit's
    counters written in the engine core reach the API server's /metrics."""
    metrics_detail: str = ""
    mode_is_default: bool = False
    """``VLLM_MAMBA_ALIGN_MODE`` is unset: the mode is the default."""
    batch_invariance: str = ""
    """What vLLM's batch-invariant mode means for the modes on this release."""
    setting_errors: list[str] = field(default_factory=list)
    """What ``register()`` raises on the current settings, one error per bad
    setting (``settings.startup_problems``): vLLM does not start with any."""
    notes: list[str] = field(default_factory=list)
    topology: list[str] = field(default_factory=list)
    """What this process does on a headless node or under Ray, when asked
    (``doctor --headless`` / ``--ray``; topology.py)."""
    serve_setting: str = ""
    """The serve settings the vLLM defects were judged for (defects.py)."""
    defects: list[dict[str, str]] = field(default_factory=list)
    """vLLM's own defects in align mode: key, title, verdict, avoid."""
    corrupting: list[str] = field(default_factory=list)
    """Keys of the defects known to corrupt output that apply to the setting
    and that a setting avoids (``--strict`` fails on them)."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)


def _vllm_root() -> Path:
    """vLLM's package directory, after checking that ``import vllm`` works."""
    try:
        import vllm  # noqa: F401  (the package must import, not only exist)
    except ImportError as error:  # includes sys.modules["vllm"] = None
        raise VllmMissing(str(error)) from error
    root = vllm_package_dir()
    if root is None:
        raise VllmMissing("the vllm package has no __file__")
    return root


def would_load(value: str | None) -> tuple[bool, str]:
    """vLLM's rule: unset loads all; otherwise exact names, comma separated."""
    if value is None:
        return True, "VLLM_PLUGINS is unset: vLLM loads every installed plugin"
    names = value.split(",")
    if PLUGIN_NAME in names:
        return True, f"VLLM_PLUGINS={value!r} names {PLUGIN_NAME}"
    near = [n for n in names if n.strip() == PLUGIN_NAME]
    hint = (
        " (vLLM does not strip spaces: remove them)"
        if near
        else f" (add {PLUGIN_NAME}, keeping every other plugin you need)"
    )
    return False, f"VLLM_PLUGINS={value!r} does not name {PLUGIN_NAME}{hint}"


def _entry_point() -> metadata.EntryPoint | None:
    for entry in metadata.entry_points(group=PLUGIN_GROUP):
        if entry.name == PLUGIN_NAME:
            return entry
    return None


def worker_seed_status(vllm_root: Path, mode: str | None) -> tuple[str, str]:
    """What MRV2's ``add_request`` seeds the running-state column with, and
    whether the plugin re-seeds it (Model Runner V2's model state; 0.34.0's CPU
    runner's too, where it is installed).

    Classified by the same fingerprints the plugin uses (releases.py), taken from
    the method's syntax tree in the source file: the module is never imported (it
    is GPU code). ``mode`` is the plugin mode (None: the setting is invalid, so
    the plugin patches nothing).
    """
    status, detail = _seed_site_status(vllm_root, WORKER_FILE, mode)
    cpu_path = vllm_root / CPU_WORKER_FILE
    if cpu_path.exists():
        detail += (
            f"; the CPU runner's ({CPU_WORKER_FILE}): "
            f"{_seed_site_status(vllm_root, CPU_WORKER_FILE, mode)[1]}"
        )
    return status, detail


def _seed_site_status(
    vllm_root: Path, worker_file: str, mode: str | None
) -> tuple[str, str]:
    path = vllm_root / worker_file
    if not path.exists():
        return "absent", f"{worker_file} is not in this vLLM (no Model Runner V2)"
    try:
        seed = method_in_file(str(path), MODEL_STATE, SEED_METHOD)
        group_info = method_in_file(str(path), MODEL_STATE, GROUP_INFO_METHOD)
    except (OSError, SyntaxError, ValueError) as error:
        return "unknown", f"could not read {path}: {error}"
    seed_fingerprint = fingerprint_node(seed) if seed else None
    site = classify_seed(
        seed_fingerprint,
        fingerprint_node(group_info) if group_info else None,
        present=seed is not None,
    )
    code = seed_code(seed_fingerprint)
    shipped = f"vLLM {code.releases}'s code" if code else "this code"
    if site is SeedSite.SEEDS_WITH_MAMBA_BLOCK:
        problem = (
            f"{shipped} seeds with cache_config.mamba_block_size, a wrong column "
            "when a hidden-state layer (extract_hidden_states) is larger per token "
            "than the common page: vLLM then multiplies every group's block, the "
            "Mamba spec's too, and leaves mamba_block_size as it was"
        )
    elif site is SeedSite.SEEDS_WITH_CACHE_BLOCK:
        problem = (
            f"{shipped} seeds with cache_config.block_size (a wrong column when "
            "C < B, vLLM issue #53142)"
        )
    elif site is SeedSite.ABSENT:
        return "absent", f"{MODEL_STATE}.{SEED_METHOD} is not in {path}"
    else:
        return (
            "unknown",
            f"unrecognized {MODEL_STATE}.{SEED_METHOD} (fingerprint "
            f"{seed_fingerprint or 'unreadable'}): left as it is",
        )
    if mode in (None, settings.Mode.OFF.value):
        return "affected", f"affected: {problem}; not patched in this mode"
    return (
        "patched",
        f"patched by the plugin: {problem}; the plugin re-seeds with the Mamba "
        "spec's block size (B)",
    )


def _retention() -> tuple[str, dict[str, str]]:
    """vLLM's default state retention, and what each mode does under it."""
    from .retention import RETENTION_VARIABLE
    from .tools.retention_report import installed_setting, mode_meaning

    has_setting, interval, where = installed_setting()
    if not has_setting:
        text = "dense: this vLLM keeps every boundary state (no retention setting)"
    elif interval is None:
        text = f"dense ({where} not set): every boundary state kept"
    elif interval == 0:
        # The variable's default is dense (0.24.0-0.28.0): 0 there is the user's.
        source = (
            f"{where}=0" if where == RETENTION_VARIABLE else f"{where}, vLLM's default"
        )
        text = f"0 ({source}): only replay boundaries and shared-prefix junctions kept"
    else:
        text = f"{interval} ({where}): multiples of it, replay boundaries, junctions"
    modes = ("lean", "kept", "full", "grid", "audit")
    return text, {mode: mode_meaning(mode, interval) for mode in modes}


def describe_batch_invariance(version: str | None) -> str:
    """What vLLM's batch-invariant mode means for the modes on this release
    (set or not)."""
    from .messages import batch_invariance_requested, except_accepting

    release = describe_version(version)
    requested = batch_invariance_requested()
    if refuses_batch_invariance_for_mamba():
        return (
            f"vLLM {release} refuses batch-invariant mode for Mamba backends"
            + except_accepting()
            + (
                f" and {BATCH_INVARIANT_VARIABLE}=1 is set: a hybrid model will "
                f"not load (unset {BATCH_INVARIANT_VARIABLE})"
                if requested
                else ""
            )
            + ": a cached continuation equals a fresh run bit for bit only for "
            "serial traffic, and only with full (or lean and kept under dense "
            "retention); lean and kept keep the states vLLM keeps with fewer "
            "prefill steps"
        )
    return (
        f"vLLM {release} accepts batch-invariant mode for hybrid models "
        + (
            f"({BATCH_INVARIANT_VARIABLE}=1 is set)"
            if requested
            else f"({BATCH_INVARIANT_VARIABLE} not set)"
        )
        + ": with it, full makes a continuation from the cache equal a fresh run "
        "also for batched traffic"
    )


def load_as_vllm_does() -> tuple[str | None, str]:
    """Resolve the platform, load the general plugins, then let the platform
    update itself, in the order vLLM's ``EngineArgs`` does; each failure is
    described, never raised. Returns the platform class and what happened."""
    done: list[str] = []
    platform_name: str | None = None
    current: object = None
    try:
        from vllm.platforms import current_platform

        current = current_platform
        klass = type(current_platform)
        platform_name = f"{klass.__module__}.{klass.__qualname__}"
        done.append("resolved as vLLM resolves it")
    except Exception as error:
        done.append(f"[!!] resolving it failed: {type(error).__name__}: {error}")
    try:
        from vllm.plugins import load_general_plugins

        load_general_plugins()
        done.append("general plugins loaded")
    except Exception as error:
        done.append(
            f"[!!] loading the general plugins failed: {type(error).__name__}: {error}"
        )
    update = getattr(current, "pre_register_and_update", None)
    if callable(update):
        try:
            update()
            done.append("its pre_register_and_update ran")
        except Exception as error:
            done.append(
                "[!!] its pre_register_and_update failed: "
                f"{type(error).__name__}: {error}"
            )
    return platform_name, "; ".join(done)


@dataclass(frozen=True)
class Intended:
    """The serve settings the operator intends (doctor's flags); None: not
    given (the runner and async scheduling then take vLLM's defaults)."""

    runner: str | None = None
    async_scheduling: bool | None = None
    speculative_method: str | None = None


def judge_defects(
    version: str | None, intended: Intended
) -> tuple[str, list[dict[str, str]], list[str]]:
    """The setting judged (in words), every defect row's verdict for it, and
    the keys ``--strict`` fails on (defects.py decides)."""
    from . import defects

    picked = defects.default_runner(version, os.environ.get(defects.RUNNER_VARIABLE))
    runner = intended.runner or picked
    asynchronous = (
        intended.async_scheduling if intended.async_scheduling is not None else True
    )
    method = intended.speculative_method
    drafter = None if method is None else ("" if method == "none" else method)
    setting = defects.Setting(version, runner, asynchronous, drafter)
    words = [
        f"Model Runner {runner.upper() if runner else 'unknown'}"
        + ("" if intended.runner else " (vLLM's pick for a hybrid)"),
        f"async scheduling {'on' if asynchronous else 'off'}"
        + ("" if intended.async_scheduling is not None else " (vLLM's default)"),
        (
            "drafter not given (--speculative-method)"
            if drafter is None
            else f"drafter {drafter or 'none'}"
        ),
    ]
    rows = [
        {
            "key": d.key,
            "title": d.title,
            "verdict": verdict.value,
            "avoid": d.avoid,
            "triggers": d.triggers,
        }
        for d, verdict in defects.assess(setting)
    ]
    corrupting = [d.key for d in defects.strict_failures(setting)]
    return ", ".join(words), rows, corrupting


def collect(
    headless: bool = False,
    ray: bool = False,
    scheduler_cls: str | None = None,
    intended: Intended | None = None,
) -> Report:
    """Inspect the installed vLLM. Raises :class:`VllmMissing` without it.
    ``headless``/``ray``: this process starts engine cores of a headless node,
    or of the Ray backend (topology.py). ``scheduler_cls``: the class vLLM is
    configured to build (its ``--scheduler-cls``), judged instead of the one
    ``vllm.v1.core.sched.scheduler.Scheduler`` names; :class:`BadSchedulerClass`
    when it cannot be."""
    root = _vllm_root()
    from .activation import Facts, Outcome, rows_walked
    from .messages import scheduler_note
    from .recognition import SPLIT_METHOD, recognize
    from .subclasses import SCHEDULER_MODULE, vllm_scheduler

    notes: list[str] = []
    platform_name, platform_detail = load_as_vllm_does()
    module = importlib.import_module(SCHEDULER_MODULE)
    # The class vLLM builds (another distribution's subclass, where a platform
    # swapped one in) is judged; vLLM's own class is what is recognized.
    scheduler_class = module.Scheduler
    if scheduler_cls is not None:
        scheduler_class = resolve_scheduler_class(
            scheduler_cls, vllm_scheduler(scheduler_class)
        )
    recognition = recognize(vllm_scheduler(scheduler_class))
    mode: Mode | None = None
    mode_error: str | None = None
    try:
        mode = settings.read_mode()
    except MambaAlignError as error:
        mode_error = str(error)
    # What the decision table reads (a setting that stops vLLM first leaves
    # the mode unread: the default stands in, and no row is walked).
    facts = Facts(mode or settings.DEFAULT_MODE, recognition, scheduler_class)
    layers = facts.findings
    foreign = any(not finding.verified for finding in layers)
    version = recognition.vllm_version
    shape = recognition.shape
    body = recognition.body
    expected = expected_body(version)
    if shape is None:
        meaning = (
            f"this vLLM has no Scheduler.{SPLIT_METHOD}: it predates align mode "
            f"(before {SUPPORTED_RELEASES[0]}); the plugin has nothing to fix"
        )
    elif recognition.split is None:
        meaning = (
            "the innermost layer of the split is not vLLM's function (see split "
            "layers): hybrid models in align mode will be refused at start, unless "
            f"{settings.MODE_VARIABLE}=off"
        )
    elif body is not None and recognition.verified:
        meaning = f"matches the verified body of vLLM {body.name}"
    elif body is not None:
        meaning = (
            "matches no verified release; running it anyway because "
            f"{settings.ALLOW_UNVERIFIED_VARIABLE}=1 and it passes the structural check"
        )
    else:
        meaning = (
            "matches no verified release (an edited, vendor or not yet verified "
            "build): hybrid models in align mode will be refused at start, "
            f"unless {settings.MODE_VARIABLE}=off"
        )

    setting_errors = settings.startup_problems()

    entry = _entry_point()
    plugins = os.environ.get("VLLM_PLUGINS")
    loads, loading_note = would_load(plugins)
    if entry is None:
        loads = False
        loading_note = (
            f"no {PLUGIN_GROUP} entry point named {PLUGIN_NAME} is visible to this "
            "Python: install vllm-mamba-align into vLLM's environment"
        )

    upstream = facts.upstream
    refusal: str | None = None
    decision: list[dict[str, str]] = []
    decided_by: str | None = None
    if setting_errors:
        refusal = "\n  ".join(setting_errors)
    else:
        walked = rows_walked(facts)
        decision = [
            {
                "row": row.key,
                "holds": {True: "yes", False: "no", None: "at start"}[held],
                "outcome": row.outcome.value,
                "says": ROW_WORDS[row.key].says,
            }
            for row, held in walked
        ]
        deciding = walked[-1][0]
        decided_by = deciding.key
        if deciding.outcome is Outcome.REFUSE:
            refused = deciding.act(facts)
            refusal = None if refused is None else str(refused)
    if upstream:
        notes.append(
            "vLLM already derives mamba_state_block_size itself (upstream fix "
            "present): the plugin stands aside"
        )
    if refusal is not None and not loads:
        notes.append(
            "the plugin would refuse, but vLLM would not load it with the current "
            "settings (see plugin loading)"
        )
    mode_name = None if mode is None else mode.value
    seed, seed_detail = worker_seed_status(root, mode_name)
    serve_setting, defect_rows, corrupting = judge_defects(
        version, intended or Intended()
    )
    export = metrics_export_status()
    retention, by_mode = _retention()
    return Report(
        plugin_version=__version__,
        python_version=platform.python_version(),
        vllm_version=version,
        vllm_location=str(root),
        split_present=shape is not None,
        split_fingerprint=shape.fingerprint if shape else None,
        split_body=body.name if body is not None and recognition.verified else None,
        split_verified=recognition.verified,
        split_meaning=meaning,
        platform=platform_name,
        platform_detail=platform_detail,
        split_layers=[finding.as_dict() for finding in layers],
        split_foreign=foreign,
        scheduler_class=f"{scheduler_class.__module__}.{scheduler_class.__qualname__}",
        scheduler_class_note=scheduler_note(scheduler_class),
        expected_fingerprint=expected.fingerprint if expected else None,
        entry_point_visible=entry is not None,
        entry_point_target=entry.value if entry is not None else None,
        vllm_plugins=plugins,
        would_load=loads,
        loading_note=loading_note,
        mode=mode_name,
        mode_error=mode_error,
        allow_unverified=settings.allow_unverified(),
        worker_seed=seed,
        worker_seed_detail=seed_detail,
        upstream_fix_present=upstream,
        retention=retention,
        retention_by_mode=by_mode,
        would_refuse=refusal is not None,
        refusal=refusal,
        decision=decision,
        decided_by=decided_by,
        setting_errors=setting_errors,
        metrics_exported=export.exported,
        metrics_detail=export.describe(),
        mode_is_default=not os.environ.get(settings.MODE_VARIABLE, "").strip(),
        batch_invariance=describe_batch_invariance(version),
        notes=notes,
        topology=[
            *(topology.headless_lines(mode_name, setting_errors) if headless else []),
            *(topology.ray_lines(platform_name) if ray else []),
        ],
        serve_setting=serve_setting,
        defects=defect_rows,
        corrupting=corrupting,
    )


def _layer_lines(layers: list[dict[str, str | None]]) -> list[str]:
    """One line per layer of the split vLLM calls, outermost first."""
    lines = []
    for number, layer in enumerate(layers, start=1):
        label = "  split layers    " if number == 1 else " " * 18
        verdict = (
            f"[!!] NOT VERIFIED, {layer['order']}"
            if layer["order"]
            else str(layer["role"])
        )
        lines.append(
            f"{label}{number}. {layer['kind']} {layer['qualname']} "
            f"({layer['module']}; {layer['distribution'] or 'no distribution'}): "
            f"{verdict}"
        )
    return lines


def _decision_lines(report: Report) -> list[str]:
    """The row of the plugin's decision table that decides here, then the rows
    before it that a model's scheduler decides at start (passed over here)."""
    if not report.decision:
        return []
    *before, deciding = report.decision
    lines = [
        f"  decision        {deciding['says']} -> {deciding['outcome']} (row "
        f"{len(report.decision)} of the plugin's table, the first that holds here)"
    ]
    at_start = [
        f"{row['says']} -> {row['outcome']}"
        for row in before
        if row["holds"] == "at start"
    ]
    if at_start:
        lines.append(
            "                  before it, decided at start by the model's scheduler: "
            + "; ".join(at_start)
        )
    return lines


def _defect_lines(report: Report) -> list[str]:
    """vLLM's own defects for the setting judged: those that apply or may,
    then one line per other verdict (the manual's page has every row)."""
    lines = [
        f"  vLLM defects    for {report.serve_setting} (every row: docs/defects.md)"
    ]
    marks = {"applies": "[!!]", "may apply": "[??]"}
    quiet: dict[str, list[str]] = {}
    for row in report.defects:
        mark = marks.get(row["verdict"])
        if mark is None:
            quiet.setdefault(row["verdict"], []).append(row["key"])
            continue
        lines.append(
            f"    {mark} {row['key']} {row['verdict']}: {row['title']} "
            f"(when: {row['triggers']}); avoid: {row['avoid']}"
        )
    lines.extend(f"    {verdict}: {', '.join(keys)}" for verdict, keys in quiet.items())
    return lines


def render_text(report: Report) -> str:
    """The human reading: one line per question an operator asks."""
    ok, bad = "ok", "!!"
    fingerprint = report.split_fingerprint or "none"
    lines = [
        f"vllm-mamba-align {report.plugin_version} doctor (Python "
        f"{report.python_version})",
        f"  vLLM            {describe_version(report.vllm_version)} "
        f"({report.vllm_location})",
        f"  platform        {report.platform or 'unknown'} ({report.platform_detail})",
        f"  split function  fingerprint {fingerprint}: {report.split_meaning}",
    ]
    if (
        report.expected_fingerprint
        and report.split_fingerprint
        and report.expected_fingerprint != report.split_fingerprint
    ):
        mismatch = describe_mismatch(
            report.vllm_version, report.expected_fingerprint, report.split_fingerprint
        )
        lines.append(f"                  ({mismatch})")
    lines.append(
        f"                  verified releases: {', '.join(SUPPORTED_RELEASES)}"
    )
    lines.extend(_layer_lines(report.split_layers))
    if report.scheduler_class_note:  # another distribution's subclass
        lines.append(f"  scheduler class {report.scheduler_class_note}")
    lines += [
        f"  entry point     {PLUGIN_GROUP}:{PLUGIN_NAME} "
        + (
            f"visible -> {report.entry_point_target}"
            if report.entry_point_visible
            else "NOT visible"
        ),
        f"  plugin loading  [{ok if report.would_load else bad}] {report.loading_note}",
        "  mode            "
        + (
            f"{report.mode}"
            + (
                f" (the default: {settings.MODE_VARIABLE} unset)"
                if report.mode_is_default
                else f" ({settings.MODE_VARIABLE})"
            )
            + (
                f" ({settings.ALLOW_UNVERIFIED_VARIABLE}=1)"
                if report.allow_unverified
                else ""
            )
            if report.mode
            else f"[{bad}] {report.mode_error}"
        ),
        f"  metrics         {report.metrics_detail}",
        f"  worker seed     {report.worker_seed_detail}",
        "  upstream fix    "
        + (
            "present in this vLLM (the plugin stands aside)"
            if report.upstream_fix_present
            else "not present (vLLM PR #54076 is in no release)"
        ),
    ]
    lines.append(f"  retention       {report.retention}")
    lines.extend(
        f"    {mode:<13} {meaning}"
        for mode, meaning in report.retention_by_mode.items()
    )
    lines.append(f"  batch-invariant {report.batch_invariance}")
    lines.extend(_decision_lines(report))
    lines.extend(_defect_lines(report))
    lines.extend(f"  note            {note}" for note in report.notes)
    lines.extend(f"  topology        {line}" for line in report.topology)
    if report.setting_errors:
        lines.append(
            "verdict: [!!] vLLM would NOT START: the plugin's register() stops "
            "it on a setting:\n  " + "\n  ".join(report.setting_errors)
        )
    elif report.would_refuse:
        lines.append(
            "verdict: [!!] the plugin would REFUSE to start a hybrid model in align "
            f"mode:\n  {report.refusal}"
        )
    elif not report.would_load:
        lines.append(
            "verdict: [!!] vLLM would not load the plugin: stock vLLM runs, with the "
            "defect"
        )
    else:
        starts = ROW_WORDS[report.decided_by].starts if report.decided_by else None
        lines.append(f"verdict: [ok] a hybrid model in align mode starts {starts}")
    if report.corrupting:
        lines.append(
            "output:  [!!] known vLLM defects corrupt output with these serve "
            f"settings: {', '.join(report.corrupting)} (see 'vLLM defects' "
            "above for the setting that avoids each)"
        )
    return "\n".join(lines)
