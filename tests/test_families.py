"""vLLM 0.34.0's hybrid families on the real scheduler, each with its Mamba spec.

One workload per spec shape (docs/production.md, "Hybrid families of vLLM
0.34.0"): the family's state shapes and dtypes from vLLM's own calculators
(``MambaStateShapeCalculator`` / ``MambaStateDtypeCalculator`` of
model_executor/layers/mamba/mamba_utils.py, the ones each family's
``get_mamba_state_shape_from_config`` calls), the block B that vLLM's platform
derives from them in align mode, an attention group of B, a smaller group (a
drafter's or a hidden-state layer's) that sets C < B, and the family's in-chunk
checkpoint backend. Each asserts what users rely on: every published Mamba hash
names the state its slot holds, the prompt's prefill finishes, and a sibling
sharing a prefix reuses its cached states.

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
from vllm_mamba_align.tools.sim import Geometry, Simulation, prompt

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
    layer: str
    """The calculator of mamba_utils.py its layers call."""
    config: tuple[tuple[str, Any], ...]
    """The calculator's arguments (a representative configuration)."""
    dtype_args: tuple[str, ...]
    """The dtype calculator's arguments after the model dtype."""
    attention_bytes_per_token: int
    """One attention layer's KV bytes per token (FullAttentionSpec or MLA)."""
    mla: bool = False
    checkpoint: str | None = None
    """The in-chunk checkpoint backend of the simulator, if the family's layer
    declares checkpoint blocks."""
    smaller_block: int = 16
    """The drafter's or hidden-state group's block: C."""

    def state(self) -> tuple[tuple[tuple[int, ...], ...], tuple[str, ...]]:
        import torch
        from vllm.model_executor.layers.mamba.mamba_utils import (
            MambaStateDtypeCalculator,
            MambaStateShapeCalculator,
        )

        shapes = getattr(MambaStateShapeCalculator, f"{self.layer}_state_shape")(
            **dict(self.config)
        )
        dtypes = getattr(MambaStateDtypeCalculator, f"{self.layer}_state_dtype")(
            torch.bfloat16, *self.dtype_args
        )
        return tuple(tuple(s) for s in shapes), tuple(str(d).split(".")[-1] for d in dtypes)

    def state_block(self) -> int:
        """B as vLLM 0.34.0's platform derives it in align mode
        (platforms/interface.py:1101-1116): the smallest multiple of the kernel
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
        "mamba2",
        (
            ("tp_world_size", 1),
            ("intermediate_size", 8192),
            ("n_groups", 8),
            ("num_heads", 128),
            ("head_dim", 64),
            ("state_size", 128),
            ("conv_kernel", 4),
        ),
        ("auto", "auto"),
        attention_bytes_per_token=2 * 8 * 128 * BF16,
        checkpoint="mamba2",
    ),
    Shape(
        "mamba1",
        ("JambaForCausalLM", "JambaForSequenceClassification"),
        "mamba1",
        (
            ("tp_world_size", 1),
            ("intermediate_size", 8192),
            ("state_size", 16),
            ("conv_kernel", 4),
        ),
        ("auto", "auto"),
        attention_bytes_per_token=2 * 8 * 128 * BF16,
    ),
    Shape(
        "gdn",
        (
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
        ),
        "gated_delta_net",
        (
            ("tp_world_size", 1),
            ("num_k_heads", 16),
            ("num_v_heads", 32),
            ("head_k_dim", 128),
            ("head_v_dim", 128),
            ("conv_kernel_size", 4),
        ),
        ("auto", "auto"),
        attention_bytes_per_token=2 * 2 * 256 * BF16,
    ),
    Shape(
        "gdn-flashinfer",
        (),  # the GDN families above, prefilling on FlashInfer
        "gated_delta_net",
        (
            ("tp_world_size", 1),
            ("num_k_heads", 16),
            ("num_v_heads", 32),
            ("head_k_dim", 128),
            ("head_v_dim", 128),
            ("conv_kernel_size", 4),
        ),
        ("auto", "auto"),
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
        "kda",
        (("tp_world_size", 1), ("num_heads", 32), ("head_dim", 128)),
        ("auto", "auto"),
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
        "kda",
        (("tp_world_size", 1), ("num_heads", 32), ("head_dim", 128)),
        ("auto", "auto"),
        attention_bytes_per_token=(512 + 64) * BF16,
        mla=True,
        checkpoint="flashkda",
    ),
    Shape(
        "linear-attention",
        ("BailingMoeV2_5ForCausalLM",),
        "linear_attention",
        (("num_heads", 16), ("tp_size", 1), ("head_dim", 128)),
        ("auto",),
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
            "ZayaForCausalLM",
        ),
        "short_conv",
        (("tp_world_size", 1), ("intermediate_size", 2048), ("conv_kernel", 3)),
        ("auto",),
        attention_bytes_per_token=2 * 8 * 64 * BF16,
    ),
)
"""Qwen4Exp (a GDN spec and a PLE short-conv spec: two Mamba groups) is the
several-specs case of issue 64, not one shape here."""

SEVERAL_SPECS = ("Qwen4ExpForCausalLM", "Qwen4ExpForConditionalGeneration")


def needs_family_release() -> None:
    if Version(installed_version() or "0").release < (0, 34):
        pytest.skip(f"the family table is read from vLLM {FAMILY_RELEASE}")


@dataclass(frozen=True)
class Outcome:
    state_block: int
    cache_block: int
    wrong: list[str]
    prompt_done: bool
    sibling_reuse: int
    shared_boundaries: int


@functools.cache
def run_shape(shape: Shape, mode: str) -> Outcome:
    """A prompt of 3.5 B tokens prefilled in chunks under a budget of 0.75 B
    (so chunks cross boundaries), then a sibling sharing its first 2.5 B."""
    b = shape.state_block()
    c = shape.smaller_block
    geometry = Geometry(
        cache_block=c,
        state_block=b,
        budget=3 * b // 4 // c * c + c // 2,
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
    record = sim.records["first"]
    return Outcome(
        state_block=b,
        cache_block=c,
        wrong=[str(p) for p in sim.poisoned.values()],
        prompt_done=record.request.num_computed_tokens >= len(first),
        sibling_reuse=sim.reused("sibling"),
        shared_boundaries=shared // b * b,
    )


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_every_family_shape_publishes_only_the_states_its_slots_hold(
    shape: Shape,
) -> None:
    needs_family_release()
    outcome = run_shape(shape, "default")
    assert outcome.cache_block < outcome.state_block, "C < B, as with a drafter"
    assert outcome.wrong == [], f"{shape.name}: wrong Mamba publications"
    assert outcome.prompt_done, f"{shape.name}: the prompt's prefill did not finish"
    assert outcome.sibling_reuse >= outcome.shared_boundaries, (
        f"{shape.name}: the sibling reused {outcome.sibling_reuse} of the "
        f"{outcome.shared_boundaries} tokens its shared prefix has cached"
    )


def test_the_shapes_cover_every_committed_family() -> None:
    from maintainers import families

    listed = set(families.committed()["architectures"])  # type: ignore[arg-type]
    covered = {f for s in SHAPES for f in s.families} | set(SEVERAL_SPECS)
    assert covered == listed


def _vllm_dir() -> Path:
    import vllm

    return Path(vllm.__file__).parent


def test_the_committed_family_list_is_the_registry_s() -> None:
    """A family vLLM adds is a failing test here until the table has its row
    (``python -m maintainers.families write``, then docs/production.md)."""
    from maintainers import families

    needs_family_release()
    record = families.committed()
    found = families.hybrid_architectures(_vllm_dir())
    if installed_version() == record["release"]:
        assert found == record["architectures"]
    else:
        new = sorted(set(found) - set(record["architectures"]))  # type: ignore[arg-type]
        assert not new, f"hybrid families without a row in the table: {new}"


def test_the_source_reading_agrees_with_vllm_where_classes_import() -> None:
    """The list is read from source; vLLM's own predicate (``is_hybrid``)
    judges it on every listed class that imports on this CPU."""
    from vllm.model_executor.models.interfaces import is_hybrid

    from maintainers import families

    needs_family_release()
    checked = 0
    for arch, where in families.hybrid_architectures(_vllm_dir()).items():
        module, _, name = where.partition(":")
        dotted = module if module.startswith("vllm.") else (
            f"vllm.model_executor.models.{module}"
        )
        try:
            cls = getattr(importlib.import_module(dotted), name)
        except (ImportError, NotImplementedError):
            continue  # an optional dependency or another platform's kernels
        assert is_hybrid(cls), arch
        checked += 1
    assert checked >= 15, f"only {checked} listed classes import here"
