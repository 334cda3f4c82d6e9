"""Features of the installed vLLM that the tools and tests adapt to.

Each reads the installed code (and imports vLLM when called): the tools run on
nightly, dev and vendor builds the release table does not list, so they ask
the code rather than the version. Which releases have each feature is a row of
the table (``releases.RELEASE_FACTS``); tests/test_release_facts.py holds every
reading here to its row on each release of the matrix. The plugin itself never
calls these.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path


def retention_in_kv_config() -> bool:
    """Whether this vLLM's KV-cache config carries the state retention
    (``releases.RETENTION_IN_KV_CONFIG``)."""
    from vllm.v1.kv_cache_interface import KVCacheConfig

    return "prefix_cache_retention_interval" in getattr(
        KVCacheConfig, "__dataclass_fields__", {}
    )


def supports_hash_block() -> bool:
    """Whether this vLLM lets the hash block be chosen (``prefix_match_unit``;
    ``releases.HASH_BLOCK_CHOSEN``)."""
    from vllm.config import CacheConfig

    return "prefix_match_unit" in getattr(CacheConfig, "__dataclass_fields__", {})


def supports_lookahead_hashes() -> bool:
    """Whether this vLLM has lookahead block hashes for EAGLE-like drafters
    (``SpeculativeConfig.disable_lookahead_block_hashes``;
    ``releases.LOOKAHEAD_HASHES``): then the scheduler drops EAGLE's last block
    only when they are turned off."""
    from vllm.config import SpeculativeConfig

    fields = getattr(SpeculativeConfig, "__dataclass_fields__", {})
    return "disable_lookahead_block_hashes" in fields


def requests_need_eos_token_id() -> bool:
    """Whether ``Request()`` requires an ``eos_token_id`` argument
    (``releases.REQUEST_NEEDS_EOS_TOKEN_ID``)."""
    from vllm.v1.request import Request

    return "eos_token_id" in inspect.signature(Request.__init__).parameters


CHECKPOINT_BACKEND_FILES: dict[str, str] = {
    "flashkda": "models/kimi_k3/nvidia/kda.py",
    "mamba2": "model_executor/layers/mamba/mamba_mixer2.py",
    "gdn-flashinfer": "model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py",
    "glm5next-flashkda": "models/glm5next/common/kda.py",
    "kimi-k3-amd": "models/kimi_k3/amd/kda.py",
    "qwen4exp-ple": "models/qwen4_exp/nvidia/ple_layer.py",
}
"""GPU backends that can declare ``MambaSpec.num_prefill_checkpoint_blocks``,
and the layer file (relative to vLLM's package directory) whose spec sets it:
KDA on flashkda (Kimi-K3 on NVIDIA GPUs), Mamba2, GDN on FlashInfer, GLM-5-Next's
KDA on flashkda, Kimi-K3's KDA on AMD GPUs (its fused or gluon chunk kernel),
and Qwen4Exp's PLE short-conv layer (a second Mamba spec beside its GDN
layers). Which of them a vLLM has is read from these files
(:func:`checkpoint_backends_in`), never from the version; which release first
has each: ``releases.CHECKPOINT_BACKENDS_SINCE``."""

_DECLARES_CHECKPOINT_BLOCKS = re.compile(r"\bnum_prefill_checkpoint_blocks\s*=")


def checkpoint_backends_in(package_dir: Path | None) -> tuple[str, ...]:
    """The backends of :data:`CHECKPOINT_BACKEND_FILES` whose layer, in the vLLM
    installed at ``package_dir``, sets ``num_prefill_checkpoint_blocks`` (a
    keyword or an assignment); () when vLLM is not installed."""
    if package_dir is None:
        return ()
    found = []
    for backend, relative in CHECKPOINT_BACKEND_FILES.items():
        try:
            text = (package_dir / relative).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if _DECLARES_CHECKPOINT_BLOCKS.search(text):
            found.append(backend)
    return tuple(found)
