"""What the plugin knows about vLLM releases: one table, one entry per split body.

Every vLLM release from 0.15.1 has ``Scheduler._mamba_block_aligned_split``; its body
changed 11 times. An entry says which code (by fingerprint) it describes, which
releases shipped it, and the three facts the fix needs to apply correctly there.
An entry is added only once the test suite has run the fix on that release.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from packaging.version import InvalidVersion, Version

from .fingerprint import CodeShape


class PrefillRule(enum.Enum):
    """How a body decides that a chunk is still prefill (only prefill is split)."""

    NO_OUTPUT_YET = "request.num_output_tokens == 0"
    """0.15.1, 0.16.0."""
    BEFORE_PREFILL_END = "start < max(num_prompt_tokens, num_tokens - 1)"
    """0.17.1 onwards: also resumed requests replaying their output tokens."""


def in_prefill(rule: PrefillRule, request: Any, start: int) -> bool:
    """Whether a chunk of ``request`` starting at ``start`` is prefill, by ``rule``.

    The fix (which stops only prefill chunks) and the audit (which counts only
    prefill chunks) must judge exactly as the installed body does.
    """
    if rule is PrefillRule.NO_OUTPUT_YET:
        return not request.num_output_tokens
    return bool(start < max(request.num_prompt_tokens, request.num_tokens - 1))


class InternalCheckpoint(enum.Enum):
    """How to tell that vLLM's backend materializes interior states itself.

    When it does, the chunk may span several state blocks: the PR's extra stop
    must not apply.
    """

    NONE = "none"
    """No internal prefill checkpointing in this body (before 0.29.0)."""
    ALIGNED_START = "mamba_has_prefill_checkpoint_blocks and start on the grid"
    """0.29.0's rule, re-derived from the scheduler's own flag."""
    OBSERVED = "vLLM's own is_mamba_prefill_checkpoint_valid() decision"
    """0.30.0+: watch the decision vLLM takes inside the split."""


@dataclass(frozen=True)
class SplitBody:
    """One distinct body of ``_mamba_block_aligned_split`` and how to fix it."""

    releases: tuple[str, ...]
    fingerprint: str
    prefill: PrefillRule
    internal_checkpoint: InternalCheckpoint
    wide_block_exemption: bool
    """Whether vLLM lets a state block wider than the step budget advance sub-block
    (0.27.1+). Without it, such a geometry stalls prefill forever."""

    @property
    def name(self) -> str:
        first, last = self.releases[0], self.releases[-1]
        return first if first == last else f"{first}-{last}"


def _body(
    releases: str,
    fingerprint: str,
    prefill: PrefillRule = PrefillRule.BEFORE_PREFILL_END,
    internal_checkpoint: InternalCheckpoint = InternalCheckpoint.NONE,
    wide_block_exemption: bool = False,
) -> SplitBody:
    return SplitBody(
        tuple(releases.split()),
        fingerprint,
        prefill,
        internal_checkpoint,
        wide_block_exemption,
    )


# Fingerprints of the wheels on PyPI; each body's source is byte-identical across
# the releases listed with it.
BODIES: tuple[SplitBody, ...] = (
    _body("0.15.1 0.16.0", "135e05b99088c4ba", PrefillRule.NO_OUTPUT_YET),
    _body("0.17.1 0.18.1 0.19.1 0.20.2 0.21.0 0.22.1", "2143cb64ffd26346"),
    _body("0.23.0", "b94b057ceb52248e"),  # 0.22.1 minus an external-token assert
    _body("0.24.0 0.25.1", "f5d07d86cd551d4f"),  # a 5th parameter, passed through
    _body("0.26.0", "ef698701aa153b4b"),  # stops tuple, partial-tail stop
    _body("0.27.1 0.28.0", "f285174274bce8f3", wide_block_exemption=True),
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
    ),
    _body(
        "0.31.0",
        "b6ec618ee4fe28dd",
        internal_checkpoint=InternalCheckpoint.OBSERVED,
        wide_block_exemption=True,
    ),
    _body(
        "0.32.0",
        "3fed017193dfee3c",
        internal_checkpoint=InternalCheckpoint.OBSERVED,
        wide_block_exemption=True,
    ),
    _body(
        "0.33.0",
        "f3405419e904a2f8",
        internal_checkpoint=InternalCheckpoint.OBSERVED,
        wide_block_exemption=True,
    ),
)

SUPPORTED_RELEASES: tuple[str, ...] = tuple(
    sorted((r for body in BODIES for r in body.releases), key=Version)
)

_BY_FINGERPRINT = {body.fingerprint: body for body in BODIES}


def body_for(fingerprint: str | None) -> SplitBody | None:
    """The known body with this fingerprint, if any."""
    if fingerprint is None:
        return None
    return _BY_FINGERPRINT.get(fingerprint)


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
    return SplitBody(
        releases=("unverified",),
        fingerprint=shape.fingerprint or "unreadable",
        prefill=prefill,
        internal_checkpoint=checkpoint,
        wide_block_exemption="max_prefill_tokens" in shape.names,
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
    """The body a release is known to ship, when the version names a release."""
    if not version:
        return None
    try:
        public = Version(version).public
    except InvalidVersion:
        return None
    for body in BODIES:
        if public in body.releases:
            return body
    return None
