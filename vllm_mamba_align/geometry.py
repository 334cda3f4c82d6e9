"""The Mamba state grid B, read from the KV-cache groups the scheduler was built with.

B is ``MambaSpec.block_size``: slot ``p`` of a request's Mamba block table holds the
state after exactly ``(p + 1) * B`` tokens. It is never ``cache_config.block_size``
(the engine sets that to the smallest block over all groups) nor
``cache_config.mamba_block_size`` (stale in the engine core with multi-process
executors).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .protocols import KVCacheConfig


@dataclass(frozen=True)
class MambaGroup:
    """One Mamba spec found in the KV-cache config, for messages."""

    group_index: int
    layer_names: tuple[str, ...]
    block_size: int

    def describe(self) -> str:
        layers = ", ".join(self.layer_names[:3])
        if len(self.layer_names) > 3:
            layers += f", … ({len(self.layer_names)} layers)"
        return f"group {self.group_index} [{layers}]: block_size={self.block_size}"


def mamba_groups(kv_cache_config: KVCacheConfig) -> list[MambaGroup]:
    """Every Mamba spec in the config, looking inside ``UniformTypeKVCacheSpecs``."""
    from vllm.v1 import kv_cache_interface

    mamba_spec = kv_cache_interface.MambaSpec
    uniform = getattr(kv_cache_interface, "UniformTypeKVCacheSpecs", None)
    found: list[MambaGroup] = []
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if uniform is not None and isinstance(spec, uniform):
            by_size: dict[int, list[str]] = {}
            for layer, inner in spec.kv_cache_specs.items():
                if isinstance(inner, mamba_spec):
                    by_size.setdefault(inner.block_size, []).append(layer)
            for size, layers in by_size.items():
                found.append(MambaGroup(index, tuple(layers), size))
        elif isinstance(spec, mamba_spec):
            found.append(MambaGroup(index, tuple(group.layer_names), spec.block_size))
    return found
