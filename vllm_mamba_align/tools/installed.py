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
