"""The refusals' words: what was expected, what was found, the ways out.

Loaded only when a row of activation's decision refuses (and by ``doctor``, which
prints the error a refusing row would raise): a scheduler that starts never
imports this module. Text only: every decision is activation's.
"""

from __future__ import annotations

from . import settings
from .errors import MambaAlignError
from .layers import Chain, Finding, Order, describe_distribution
from .recognition import SPLIT_METHOD, Recognition
from .releases import (
    SUPPORTED_RELEASES,
    V1_RUNNER_REMOVED_IN,
    WORKER_CHECKS_GROUPS_AT_START_SINCE,
    SplitBody,
    describe_mismatch,
    describe_releases,
    describe_version,
    expected_body,
    release_range,
    releases_where,
)
from .subclasses import describe_class, foreign_classes
from .version import __version__


def refuse_unknown_code(recognition: Recognition) -> MambaAlignError:
    """vLLM's split is code the plugin has not verified."""
    shape = recognition.shape
    found = shape.fingerprint if shape and shape.fingerprint else "unreadable source"
    if shape and shape.problem:
        found += f" ({shape.problem})"
    expected = expected_body(recognition.vllm_version)
    known = (
        f" {describe_mismatch(recognition.vllm_version, expected.fingerprint, found)}."
        if expected
        else ""
    )
    newest = SUPPORTED_RELEASES[-1]
    if shape and shape.structurally_compatible:
        opt_in = (
            f"(2) set {settings.ALLOW_UNVERIFIED_VARIABLE}=1 to run the fix on this "
            "code anyway: the plugin then checks only that the function reads "
            "self.cache_config.block_size exactly once and takes the released "
            "parameters (this code does), and applies the newest rules whose names "
            "the code uses; nothing else about this code has been tested"
        )
    else:
        opt_in = (
            f"(2) {settings.ALLOW_UNVERIFIED_VARIABLE}=1 cannot help: this code "
            "does NOT pass the structural check it requires (exactly one read of "
            "self.cache_config.block_size, the released parameters)"
        )
    return MambaAlignError(
        f"vllm-mamba-align {__version__}: this model needs vLLM's align-mode chunk "
        "split, but the installed Scheduler._mamba_block_aligned_split is code the "
        f"plugin has not verified (vLLM {describe_version(recognition.vllm_version)}"
        f", fingerprint {found}).{known} The newest vLLM release vllm-mamba-align "
        f"{__version__} has verified is {newest}. Verified releases: "
        f"{', '.join(SUPPORTED_RELEASES)}. Ways out: (1) pin vLLM to a "
        f"verified release (pip install vllm=={newest}); {opt_in}; (3) set "
        f"{settings.MODE_VARIABLE}=off (or leave mamba_align out of VLLM_PLUGINS) "
        "to run vLLM's own split unchanged, defect included. Please report this "
        "vLLM on the plugin's issue tracker with the output of "
        "`vllm-mamba-align doctor --json` attached."
    )


def refuse_disagreeing_groups(listing: str, version: str | None) -> MambaAlignError:
    """The Mamba groups reaching the scheduler disagree on their block size.

    In align mode vLLM gives every Mamba layer one block size, the attention
    block, whatever ``--mamba-block-size`` says (0.15.0-0.19.1
    model_executor/models/config.py, 0.20.0+ platforms/interface.py; each Mamba
    layer's spec takes ``cache_config.mamba_block_size``, layers/mamba/abstract.py):
    a group that differs comes from
    a layer spec that sets its own (a model's or another plugin's code). Where
    vLLM's own worker stops such a model before the scheduler exists, the
    message says this refusal is reached only past it."""
    checks = WORKER_CHECKS_GROUPS_AT_START_SINCE
    lazy = release_range(before=checks)
    v1 = release_range(checks, before=V1_RUNNER_REMOVED_IN)
    where = (
        f"vLLM {lazy} starts such a model and checks the groups only at the "
        f"worker's first step; from {checks} Model Runner V2 stops it while the "
        'worker initializes its KV cache ("all mamba groups must share cache '
        'scheduling parameters"), so this refusal is reached there only with '
        f"Model Runner V1 ({v1}: VLLM_USE_V2_MODEL_RUNNER=0) or a worker that is "
        "not vLLM's"
    )
    return MambaAlignError(
        "vllm-mamba-align: the Mamba KV-cache groups disagree on their block "
        f"size ({listing}). Align-mode prefix caching needs one state grid, so "
        f"the scheduler is not started (vLLM {describe_version(version)}). In "
        "align mode vLLM sets every Mamba layer's block size to the attention "
        "block, whatever --mamba-block-size says, so the group that differs "
        "comes from a layer spec that sets its own (the model's code or another "
        "plugin's). Ways out: turn prefix caching off for this model "
        "(--no-enable-prefix-caching), or give that layer's spec the others' "
        f"block size. ({where}.)"
    )


def refuse_stall(
    body: SplitBody, state_grid: int, budget: int, source: str
) -> MambaAlignError:
    """The state block is wider than the step budget on a body that floors
    every non-final chunk to the grid."""
    return MambaAlignError(
        f"vllm-mamba-align: the Mamba state block B={state_grid} is larger than "
        f"the per-step prefill budget {budget} ({source}). On vLLM "
        f"{body.name} a prefill chunk must end on the state grid, so no request "
        f"could ever finish its prefill. Raise --max-num-batched-tokens (and "
        f"--long-prefill-token-threshold, if set) to at least {state_grid}, or "
        "lower --mamba-block-size, or upgrade to vLLM "
        f"{describe_releases(releases_where(lambda b: b.wide_block_exemption))} "
        "(which lets a wide block advance in sub-block steps)."
    )


def refuse_subclass(
    scheduler_class: type, klass: type, reasons: list[str]
) -> MambaAlignError:
    """Another distribution's subclass of vLLM's ``Scheduler`` lacks what the
    fix relies on (``reasons``, subclasses.py)."""
    built = (
        ""
        if klass is scheduler_class
        else f" (an ancestor of {describe_class(scheduler_class)})"
    )
    return MambaAlignError(
        f"vllm-mamba-align {__version__}: this model needs vLLM's align-mode chunk "
        f"split, and the scheduler vLLM builds is {describe_class(klass)}{built}, "
        "a subclass of vLLM's Scheduler from another distribution. It inherits "
        f"vLLM's own {SPLIT_METHOD}, but the fix also relies on the subclass "
        "calling that split only as self."
        f"{SPLIT_METHOD}(...) with vLLM's arguments and on attributes bound on the "
        f"scheduler taking effect, and its code does not: {'; '.join(reasons)}. "
        "The plugin starts its fix only inside code it has checked, so it refuses "
        "to start this scheduler rather than run the fix half applied. Ways out: "
        f"(1) set {settings.MODE_VARIABLE}=off: the plugin binds nothing on this "
        "scheduler and it runs unchanged (vLLM's defect included); (2) leave "
        "mamba_align out of VLLM_PLUGINS (list every other plugin you need, your "
        "platform plugin included); (3) report it on the plugin's issue tracker "
        "with the output of `vllm-mamba-align doctor --json` attached."
    )


def refuse_unverified_layers(
    recognition: Recognition, chain: Chain, found: tuple[Finding, ...]
) -> MambaAlignError:
    """A layer of the split the plugin has not verified: another plugin's
    wrapper, or a subclass's override."""
    unverified = [finding for finding in found if not finding.verified]
    plugins = ", ".join(
        dict.fromkeys(
            describe_distribution(finding.layer.module) for finding in unverified
        )
    )
    owner = chain.owner
    if unverified[0].order is Order.OVERRIDE and owner is not None:
        headline = (
            f"{owner.__qualname__} overrides {SPLIT_METHOD} with code the plugin "
            f"has not verified ({plugins})"
        )
    else:
        headline = (
            f"another plugin patched vLLM's Scheduler.{SPLIT_METHOD} with code "
            f"the plugin has not verified ({plugins})"
        )
    layers = "; ".join(
        _describe_finding(number, finding, recognition)
        for number, finding in enumerate(found, start=1)
    )
    return MambaAlignError(
        f"vllm-mamba-align {__version__}: this model needs vLLM's align-mode chunk "
        f"split, but {headline}. The split a {_scheduler_named(chain)} calls, "
        f"outermost layer first: {layers}. The plugin runs only code it has "
        "verified inside its fix and has no rule for composing the fix with "
        "another plugin's split, so it refuses to start this scheduler rather than "
        "change or bypass that split. Ways out: (1) set "
        f"{settings.MODE_VARIABLE}=off: the plugin binds nothing on this scheduler "
        "and that split runs unchanged (vLLM's defect included); (2) leave "
        "mamba_align out of VLLM_PLUGINS (list every other plugin you need, your "
        "platform plugin included); (3) report it on the plugin's issue tracker "
        "with the output of `vllm-mamba-align doctor --json` attached. "
        f"{settings.ALLOW_UNVERIFIED_VARIABLE} does not apply to another plugin's "
        "code."
    )


def _describe_finding(number: int, finding: Finding, recognition: Recognition) -> str:
    text = f"{number}. {finding.layer.describe()}, {finding.where}: "
    if finding.order is not None:
        return text + f"NOT VERIFIED, {finding.order.value}"
    if finding.layer.ours:
        return text + "this plugin's wrapper"
    body = recognition.body
    shape = recognition.shape
    fingerprint = shape.fingerprint if shape else None
    if body is not None and recognition.verified:
        return text + f"vLLM's own function, split body {body.name} ({fingerprint})"
    return text + f"vLLM's function, matching no verified release ({fingerprint})"


def _scheduler_named(chain: Chain) -> str:
    klass = chain.scheduler_class
    if foreign_classes(klass):
        return describe_class(klass)
    return klass.__qualname__
