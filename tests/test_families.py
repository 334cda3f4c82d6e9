"""vLLM 0.34.0's hybrid families on the real scheduler, each with its Mamba spec.

One workload per spec shape (docs/production.md, "Hybrid families of vLLM
0.34.0"): the state built by one of the shape's families' own
``get_mamba_state_shape_from_config`` / ``get_mamba_state_dtype_from_config``
(the others call the same calculator of mamba_utils.py), the block B that vLLM's
platform derives from it in align mode, an attention group of B, a smaller group
(a drafter's or a hidden-state layer's) that sets C < B, and the family's
in-chunk checkpoint backend. In every fixing mode, the simulation's oracle and
the independent witness (tests/witness) both find every published Mamba hash
naming the state its slot holds and every read right; the prompt's prefill
finishes and a sibling sharing a prefix reuses its cached states. The ``off``
twin shows the same load publishing wrong states.

The committed family list (maintainers/data/hybrid-families.json) is held here
to the installed registry, and the source reading that produced it to vLLM's
own ``is_hybrid`` on every class that imports on CPU.
"""

from __future__ import annotations

import functools
import importlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from helpers import scheduler_mode
from packaging.version import Version

from vllm_mamba_align.releases import installed_version
from vllm_mamba_align.tools.sim import (
    Geometry,
    Simulation,
    cacheable_boundaries,
    prompt,
)

FAMILY_RELEASE = "0.34.0"
"""The release whose registry the committed list and the table are read from."""

KERNEL_BLOCK = 64
"""The attention block vLLM 0.34.0 starts from (``CacheConfig.DEFAULT_BLOCK_SIZE``,
a multiple of FlashAttention's kernel block 16): the unit B is rounded up in."""

MLA_KERNEL_BLOCK = 128
"""The unit for models whose attention is MLA (platforms/interface.py:1093-1097)."""


@dataclass(frozen=True)
class Shape:
    """One Mamba spec shape and the families that build it."""

    name: str
    families: tuple[str, ...]
    """Registry architectures (maintainers/data/hybrid-families.json)."""
    model: str
    """``module:Class`` of one of them that imports on CPU: its own
    ``get_mamba_state_shape_from_config`` / ``…_dtype_from_config`` build the
    state (the others call the same calculator; docs/production.md cites each)."""
    config: tuple[tuple[str, Any], ...]
    """The hf_config fields those read (a representative configuration)."""
    attention_bytes_per_token: int
    """One attention layer's KV bytes per token (FullAttentionSpec or MLA)."""
    mla: bool = False
    checkpoint: str | None = None
    """The in-chunk checkpoint backend of the simulator, if the family's layer
    declares checkpoint blocks on it."""
    smaller_block: int = 16
    """The drafter's or hidden-state group's block: C."""

    def state(self) -> tuple[tuple[tuple[int, ...], ...], tuple[str, ...]]:
        """(shapes, dtype names) from the family's own classmethods, given the
        few config objects they read (bf16 model, caches ``auto``, TP 1, no
        drafter, no ReplaySSM)."""
        from types import SimpleNamespace

        import torch

        module, _, name = self.model.partition(":")
        cls = getattr(importlib.import_module(module), name)
        hf_config = SimpleNamespace(**dict(self.config))
        vllm_config = SimpleNamespace(
            model_config=SimpleNamespace(
                hf_config=hf_config, hf_text_config=hf_config, dtype=torch.bfloat16
            ),
            parallel_config=SimpleNamespace(tensor_parallel_size=1),
            cache_config=SimpleNamespace(
                mamba_cache_dtype="auto",
                mamba_ssm_cache_dtype="auto",
                use_replayssm=False,
            ),
            speculative_config=None,
            num_speculative_tokens=0,
        )
        shapes = cls.get_mamba_state_shape_from_config(vllm_config)
        dtypes = cls.get_mamba_state_dtype_from_config(vllm_config)
        return (
            tuple(tuple(shape) for shape in shapes),
            tuple(str(dtype).split(".")[-1] for dtype in dtypes),
        )

    def state_block(self) -> int:
        """B as vLLM 0.34.0's platform derives it in align mode
        (platforms/interface.py:1101-1127): the smallest multiple of the kernel
        block whose attention page holds the Mamba page (MambaSpec's
        ``page_size_bytes``), and a multiple of the checkpoint alignment."""
        import torch
        from vllm.v1.kv_cache_interface import MambaSpec

        shapes, dtypes = self.state()
        page = MambaSpec(
            shapes=shapes,
            dtypes=tuple(getattr(torch, d) for d in dtypes),
            block_size=-1,
        ).page_size_bytes
        unit = MLA_KERNEL_BLOCK if self.mla else KERNEL_BLOCK
        if self.checkpoint == "flashkda":
            unit = math.lcm(unit, 16)
        return unit * -(-page // (unit * self.attention_bytes_per_token))


BF16 = 2
MODELS = "vllm.model_executor.models"
MAMBA2 = (
    ("mamba_num_heads", 128),
    ("mamba_head_dim", 64),
    ("n_groups", 8),
    ("ssm_state_size", 128),
    ("conv_kernel", 4),
)
GDN = (
    ("linear_num_key_heads", 16),
    ("linear_num_value_heads", 32),
    ("linear_key_head_dim", 128),
    ("linear_value_head_dim", 128),
    ("linear_conv_kernel_dim", 4),
)
KDA = (
    (
        "linear_attn_config",
        {"num_heads": 32, "head_dim": 128, "short_conv_kernel_size": 4},
    ),
)
QWEN3_5 = (
    "ClefFlashForJointSchema",
    "ColQwen3_5",
    "InternS2MobiusForConditionalGeneration",
    "InternS2PreviewForConditionalGeneration",
    "MiniCPMOcrForConditionalGeneration",
    "MiniCPMV4_6ForConditionalGeneration",
    "MiniCPMV4_7ForConditionalGeneration",
    "OlmoHybridForCausalLM",
    "Qwen3NextForCausalLM",
    "Qwen3_5ForCausalLM",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForCausalLM",
    "Qwen3_5MoeForConditionalGeneration",
)
SHAPES = (
    Shape(
        "mamba2",
        (
            "FalconH1ForCausalLM",
            "GraniteMoeHybridForCausalLM",
            "NemotronHForCausalLM",
            "NemotronHPuzzleForCausalLM",
            "NemotronH_Nano_Omni_Reasoning_V3",
            "NemotronH_Nano_VL_V2",
            "NemotronH_Omni_Reasoning_V3",
            "NemotronH_Super_Omni_Reasoning_V3",
            "Nemotron3_5TranscribeForConditionalGeneration",
            "Zamba2ForCausalLM",
        ),
        f"{MODELS}.nemotron_h:NemotronHForCausalLM",
        MAMBA2,
        attention_bytes_per_token=2 * 8 * 128 * BF16,
        checkpoint="mamba2",
    ),
    Shape(
        "mamba1",
        ("JambaForCausalLM", "JambaForSequenceClassification"),
        f"{MODELS}.jamba:JambaForCausalLM",
        (
            ("hidden_size", 4096),
            ("mamba_expand", 2),
            ("mamba_d_state", 16),
            ("mamba_d_conv", 4),
        ),
        attention_bytes_per_token=2 * 8 * 128 * BF16,
    ),
    Shape(
        "gdn",
        QWEN3_5,
        f"{MODELS}.qwen3_next:Qwen3NextForCausalLM",
        GDN,
        attention_bytes_per_token=2 * 2 * 256 * BF16,
    ),
    Shape(
        "gdn-flashinfer",
        (),  # the GDN families above, prefilling on FlashInfer
        f"{MODELS}.qwen3_next:Qwen3NextForCausalLM",
        GDN,
        attention_bytes_per_token=2 * 2 * 256 * BF16,
        checkpoint="gdn-flashinfer",
    ),
    Shape(
        "kda",
        (
            "AliceAIForCausalLM",
            "BailingMoeV3ForCausalLM",
            "BailingMoeV3VLForConditionalGeneration",
            "KimiLinearForCausalLM",
            "MingV3ASRForConditionalGeneration",
        ),
        "vllm.models.kimi_k3:KimiLinearForCausalLM",
        KDA,
        attention_bytes_per_token=(512 + 64) * BF16,
        mla=True,
    ),
    Shape(
        "kda-flashkda",
        (
            "Glm5NextForCausalLM",
            "Glm5NextForConditionalGeneration",
            "KimiK31ForConditionalGeneration",
            "KimiK3ForConditionalGeneration",
        ),
        "vllm.models.kimi_k3:KimiLinearForCausalLM",
        KDA,
        attention_bytes_per_token=(512 + 64) * BF16,
        mla=True,
        checkpoint="flashkda",
    ),
    Shape(
        "linear-attention",
        ("BailingMoeV2_5ForCausalLM",),
        f"{MODELS}.bailing_moe_linear:BailingMoeV25ForCausalLM",
        (("num_attention_heads", 16), ("head_dim", 128), ("hidden_size", 2048)),
        attention_bytes_per_token=2 * 4 * 128 * BF16,
    ),
    Shape(
        "short-conv",
        (
            "ColBERTLfm2Model",
            "Lfm2ForCausalLM",
            "Lfm2MoeForCausalLM",
            "Lfm2VlForConditionalGeneration",
            "Lfm3AudioForConditionalGeneration",
            "Lfm3ForCausalLM",
            "Lfm3VlForConditionalGeneration",
        ),
        f"{MODELS}.lfm2:Lfm2ForCausalLM",
        (("conv_dim", 2048), ("conv_L_cache", 3)),
        attention_bytes_per_token=2 * 8 * 64 * BF16,
    ),
    Shape(
        "cca",
        ("ZayaForCausalLM",),
        f"{MODELS}.zaya:ZayaForCausalLM",
        (
            ("num_attention_heads", 16),
            ("num_key_value_heads", 2),
            ("head_dim", 128),
            ("cca_time0", 2),
            ("cca_time1", 2),
        ),
        attention_bytes_per_token=2 * 2 * 128 * BF16,
    ),
)
"""Qwen4Exp (a GDN spec and a PLE short-conv spec: two Mamba groups) is the
several-specs case of issue 64, not one shape here."""

SEVERAL_SPECS = ("Qwen4ExpForCausalLM", "Qwen4ExpForConditionalGeneration")


def needs_family_release() -> None:
    if Version(installed_version() or "0").release < (0, 34):
        pytest.skip(f"the family table is read from vLLM {FAMILY_RELEASE}")


CHECKPOINT_ALIGNMENT = {"mamba2": 1, "flashkda": 16, "gdn-flashinfer": 64}
"""Each backend's ``prefill_checkpoint_alignment`` at this test's geometry
(hash block 16): Mamba2 1 (mamba_mixer2.py:1097-1098), flashkda 16
(layers/mamba/kda_checkpoint.py:9-10), GDN on FlashInfer the prefix-cache
grid, lcm(16, 64) (qwen_gdn_linear_attn.py:911, abstract.py:124-137)."""


@dataclass(frozen=True)
class Outcome:
    state_block: int
    cache_block: int
    wrong: list[str]
    """The simulation's oracle: published Mamba hashes over another state."""
    prompt_done: bool
    materialized: list[int]
    """The prompt's B boundaries whose state a published block holds."""
    boundaries: list[int]
    sibling_reuse: int
    shared_boundaries: int
    witness: Any
    """The witness's findings (tests/witness: an independent judge)."""
    witness_events: Any


LOADS = {"narrow": (3, 4), "wide": (7, 3)}
"""Step budgets as a fraction of B: ``narrow`` (0.75 B: every chunk ends off
B's grid on C's, so stock publishes a wrong state at each boundary and hands
the sibling one) and ``wide`` (2.33 B: a chunk from a boundary reaches past
the next two, so only a stop at each boundary materializes them all)."""


def run_shape(shape: Shape, mode: str, load: str) -> Outcome:
    return _run_shape(shape.name, mode, load)


@functools.cache
def _run_shape(name: str, mode: str, load: str) -> Outcome:
    """A prompt of 3.5 B tokens prefilled under the load's budget, then a
    sibling sharing its first 2.5 B."""
    shape = next(s for s in SHAPES if s.name == name)
    b = shape.state_block()
    c = shape.smaller_block
    numerator, denominator = LOADS[load]
    geometry = Geometry(
        cache_block=c,
        state_block=b,
        budget=numerator * b // denominator // c * c + c // 2,
        hash_block=math.gcd(b, c),
        retention=None,
        prefill_checkpoint=shape.checkpoint,
        mamba_state=shape.state(),
        attention_block=b,
    )
    first = prompt(7 * b // 2, seed=11)
    shared = 5 * b // 2
    with scheduler_mode(mode):
        sim = Simulation(geometry)
        sim.add("first", first)
        sim.run()
        sim.add("sibling", first[:shared] + prompt(b, seed=12))
        sim.run()
        findings, events = _witnessed(shape, geometry, first, shared)
    record = sim.records["first"]
    return Outcome(
        witness=findings,
        witness_events=events,
        state_block=b,
        cache_block=c,
        wrong=[str(p) for p in sim.poisoned.values()],
        prompt_done=record.request.num_computed_tokens >= len(first),
        materialized=sim.materialized_boundaries("first"),
        boundaries=cacheable_boundaries(len(first), b),
        sibling_reuse=sim.reused("sibling"),
        shared_boundaries=shared // b * b,
    )


def _witnessed(
    shape: Shape, geometry: Geometry, first: list[int], shared: int
) -> tuple[Any, Any]:
    """The same load under the witness: its own engine, the family's spec."""
    from witness import engine, workloads

    witness_shape = engine.Shape(
        state_block=geometry.state_block,
        attention_block=geometry.state_block,
        drafter_block=geometry.cache_block,
        budget=geometry.budget,
        retention=None,
        num_prefill_checkpoint_blocks=int(shape.checkpoint is not None),
        prefill_checkpoint_alignment=CHECKPOINT_ALIGNMENT.get(shape.checkpoint or ""),
        mamba_state=shape.state(),
    )
    arrivals = (
        workloads.Arrival(0, "first", tuple(first), 1),
        workloads.Arrival(
            0,
            "sibling",
            tuple(first[:shared] + prompt(geometry.state_block, seed=12)),
            1,
            after="first",
        ),
    )
    return workloads.drive(workloads.Workload(shape.name, witness_shape, arrivals))


FIXING_MODES = ("full", "kept", "grid", "lean")


@pytest.mark.parametrize("load", LOADS)
@pytest.mark.parametrize("mode", FIXING_MODES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_every_family_shape_publishes_only_the_states_its_slots_hold(
    shape: Shape, mode: str, load: str
) -> None:
    needs_family_release()
    outcome = run_shape(shape, mode, load)
    assert outcome.cache_block < outcome.state_block, "C < B, as with a drafter"
    assert outcome.wrong == [], f"{shape.name}: wrong Mamba publications"
    witness = outcome.witness
    assert witness.publications > 0
    assert (witness.wrong_publications, witness.wrong_reads) == (0, 0), witness.examples
    assert outcome.witness_events.unfinished == []
    if mode != "grid":  # grid stops at no boundary (docs/modes.md)
        assert outcome.materialized == outcome.boundaries
        assert witness.lost_kept_states == 0, witness.examples
    assert outcome.prompt_done, f"{shape.name}: the prompt's prefill did not finish"
    assert outcome.witness_events.cache_hits == 1, "the sibling hits the cache"
    assert outcome.sibling_reuse >= outcome.shared_boundaries, (
        f"{shape.name}: the sibling reused {outcome.sibling_reuse} of the "
        f"{outcome.shared_boundaries} tokens its shared prefix has cached"
    )


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_off_publishes_wrong_states_on_every_family_shape(shape: Shape) -> None:
    """The twin: the same loads as stock vLLM runs them (``off``) publish
    states their slots do not hold, hand the sibling one, and leave boundary
    states unwritten, so the test above cannot pass vacuously."""
    needs_family_release()
    narrow, wide = run_shape(shape, "off", "narrow"), run_shape(shape, "off", "wide")
    assert narrow.wrong and narrow.witness.wrong_publications > 0
    assert narrow.witness.wrong_reads > 0
    assert wide.materialized != wide.boundaries


def test_the_shapes_cover_every_committed_family() -> None:
    from maintainers import families

    listed = set(families.committed()["architectures"])  # type: ignore[arg-type]
    covered = {f for s in SHAPES for f in s.families} | set(SEVERAL_SPECS)
    assert covered == listed


@functools.cache
def _read_registry() -> dict[str, str]:
    """The installed registry's hybrid architectures, read from source."""
    import vllm

    from maintainers import families

    return families.hybrid_architectures(Path(vllm.__file__).parent)


def test_the_committed_family_list_is_the_registry_s() -> None:
    """A family vLLM adds is a failing test here until the table has its row
    (``python -m maintainers.families write``, then docs/production.md)."""
    from maintainers import families

    needs_family_release()
    record = families.committed()
    found = _read_registry()
    if installed_version() == record["release"]:
        assert found == record["architectures"]
    else:
        new = sorted(set(found) - set(record["architectures"]))  # type: ignore[arg-type]
        assert not new, f"hybrid families without a row in the table: {new}"


def test_the_source_reading_agrees_with_vllm_where_classes_import() -> None:
    """The list is read from source; vLLM's own predicate (``is_hybrid``)
    judges it on every listed class that imports on this CPU, and on every
    unlisted class whose module those imports loaded."""
    import sys

    import vllm
    from vllm.model_executor.models.interfaces import is_hybrid

    from maintainers import families

    needs_family_release()
    listed = _read_registry()
    checked = 0
    for arch, where in listed.items():
        module, _, name = where.partition(":")
        try:
            cls = getattr(importlib.import_module(_dotted(module)), name)
        except (ImportError, NotImplementedError):
            continue  # an optional dependency or another platform's kernels
        assert is_hybrid(cls), f"{arch} is listed, vLLM says not hybrid"
        checked += 1
    assert checked >= 15, f"only {checked} listed classes import here"
    entries = families.registry_entries(Path(vllm.__file__).parent)
    unlisted = 0
    for arch, (module, name) in entries.items():
        loaded = sys.modules.get(_dotted(module))
        if arch in listed or loaded is None:
            continue
        try:
            cls = getattr(loaded, name)
        except (ImportError, AttributeError, NotImplementedError):
            continue  # a package that loads its classes on first use
        assert not is_hybrid(cls), f"{arch} is hybrid, not listed"
        unlisted += 1
    assert unlisted >= 10, f"only {unlisted} unlisted classes judged"


def _dotted(module: str) -> str:
    """A registry module as a dotted path."""
    if module.startswith("vllm."):
        return module
    return f"vllm.model_executor.models.{module}"
