"""What the plugin found when vLLM's scheduler module was imported.

:func:`recognize` walks the split vLLM's ``Scheduler`` class holds, layer by
layer (layers.py), fingerprints its innermost function and picks the rules for
it (releases.py); :func:`split_findings` judges the layers of any split chain
against that recognition. The plugin recognizes once per process (plugin.py);
activation and ``doctor`` read the same :class:`Recognition`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import settings
from .fingerprint import CodeShape, analyse_function
from .layers import Chain, Finding, Kind, Layer, findings, walk
from .releases import SplitBody, body_for, installed_version

SPLIT_METHOD = "_mamba_block_aligned_split"


@dataclass(frozen=True)
class Recognition:
    """What the plugin found when vLLM's scheduler module was imported."""

    vllm_version: str | None
    shape: CodeShape | None
    """None when this vLLM has no ``_mamba_block_aligned_split`` at all."""
    body: SplitBody | None
    """The known body, or the best-effort rules of an opted-in unverified body."""
    verified: bool
    split: Any = None
    """vLLM's own ``_mamba_block_aligned_split`` function: the innermost layer of
    the class attribute, defined in the scheduler's module (None: no such layer)."""
    layers: tuple[Layer, ...] = ()
    """Every layer of the class attribute when vLLM's scheduler module was
    imported, outermost first, this plugin's own left out (layers.py)."""
    scheduler_class: type | None = None
    """The class recognized (and patched): vLLM's ``Scheduler``."""

    @property
    def foreign(self) -> tuple[Layer, ...]:
        """The layers found at import that are not vLLM's own function."""
        return tuple(layer for layer in self.layers if layer.target is not self.split)


def recognize(scheduler_class: type) -> Recognition:
    """Identify the installed split function and pick the rules for it.

    ``scheduler_class`` is vLLM's own ``Scheduler`` (``subclasses.vllm_scheduler``).
    The class attribute is walked layer by layer (layers.py): what is
    fingerprinted is the innermost function, and it counts as vLLM's own only
    when it is a plain function of the scheduler's module. Every other layer
    (another plugin's wrapper, found here when that plugin patched first) is kept
    in the recognition, and activation's decision table refuses it.
    """
    version = installed_version()
    chain = walk(scheduler_class, SPLIT_METHOD)
    layers = tuple(layer for layer in chain.layers if not layer.ours)
    if not layers:
        return Recognition(
            version, None, None, verified=False, scheduler_class=scheduler_class
        )
    innermost = layers[-1]
    own = (
        chain.complete
        and innermost.kind is Kind.FUNCTION
        and innermost.module == scheduler_class.__module__
    )
    shape = analyse_function(innermost.target)
    body = body_for(shape.fingerprint) if own else None
    verified = body is not None
    if own and body is None and settings.allow_unverified():
        from .unverified import unverified_body

        body = unverified_body(shape) if shape.structurally_compatible else None
    return Recognition(
        version,
        shape,
        body,
        verified=verified,
        split=innermost.target if own else None,
        layers=layers,
        scheduler_class=scheduler_class,
    )


def split_findings(recognition: Recognition, chain: Chain) -> tuple[Finding, ...]:
    """Every layer of a split chain, judged: this plugin's wrapper, vLLM's
    function the plugin recognized, or not verified (layers.py)."""
    return findings(
        chain, recognition.split, recognition.layers, recognition.scheduler_class
    )
