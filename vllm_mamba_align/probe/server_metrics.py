"""What a server's ``/metrics`` says about the fix and about prefix caching.

Read when the endpoint is there (vLLM serves it by default), never required:

- ``vllm_mamba_align_info`` (``vllm_mamba_align.metrics.INFO``): the plugin's
  mode, status and grids per engine. It reaches the API server's ``/metrics``
  only when Prometheus runs in multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``
  set before ``vllm serve``); its absence does not mean the plugin is absent.
- ``vllm:cache_config_info``: the API server's ``CacheConfig`` as labels:
  ``enable_prefix_caching``, ``mamba_cache_mode``, ``mamba_block_size`` (B, once
  vLLM has sized it), ``prefix_cache_retention_interval`` (0.29.0+). Its
  ``block_size`` is the front end's, not the engine core's C, so it is not used.
- ``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total``: tokens
  looked up and found in the prefix cache, read before and after the probe. They
  count every client's traffic, so on a busy server they bound, not measure,
  what the probe reused.
- ``vllm:prompt_tokens_total``: prompt tokens of every request the server
  prefilled. Every client's requests only add to it, so between two scrapes of
  one server it grows by at least what the probe sent: when it grows by less,
  the probe's requests (or the scrapes) reached servers other than the one
  whose ``/metrics`` was read (replicas behind a load balancer).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ..metrics import INFO

CACHE_CONFIG_INFO = "vllm:cache_config_info"
QUERIES = "vllm:prefix_cache_queries_total"
HITS = "vllm:prefix_cache_hits_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"

SAMPLE = re.compile(
    r"^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)"
)
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """Every sample of metric ``name`` in a Prometheus text exposition."""
    found = []
    for line in text.splitlines():
        match = SAMPLE.match(line)
        if match is None or match["name"] != name:
            continue
        try:
            value = float(match["value"])
        except ValueError:
            continue
        found.append((dict(LABEL.findall(match["labels"] or "")), value))
    return found


def _for_model(
    found: list[tuple[dict[str, str], float]], model: str | None
) -> list[tuple[dict[str, str], float]]:
    """The samples of one served model, when they carry a ``model_name``."""
    if model is None:
        return found
    mine = [(labels, v) for labels, v in found if labels.get("model_name") == model]
    return mine or [(labels, v) for labels, v in found if "model_name" not in labels]


def _int(value: str | None) -> int | None:
    try:
        return None if value is None else int(value)
    except ValueError:
        return None


@dataclass(frozen=True)
class ServerMetrics:
    """One scrape of ``/metrics`` (``available`` False when there was none)."""

    available: bool
    plugin: tuple[dict[str, str], ...] = ()
    """The plugin's info series, one per engine."""
    cache_config: dict[str, str] = field(default_factory=dict)
    queries: float | None = None
    hits: float | None = None
    hits_by_engine: dict[str, float] = field(default_factory=dict)
    """``vllm:prefix_cache_hits_total`` per ``engine`` label (one per engine
    core of a data-parallel server)."""
    prompt_tokens: float | None = None
    """``vllm:prompt_tokens_total``, every engine's."""
    prompt_tokens_by_engine: dict[str, float] = field(default_factory=dict)
    """``vllm:prompt_tokens_total`` per ``engine`` label."""

    @property
    def prefix_caching(self) -> bool | None:
        value = self.cache_config.get("enable_prefix_caching")
        return None if value is None else value == "True"

    @property
    def plugin_state_block(self) -> int | None:
        blocks = {_int(info.get("state_block")) for info in self.plugin}
        blocks.discard(None)
        return blocks.pop() if len(blocks) == 1 else None

    @property
    def config_state_block(self) -> int | None:
        return _int(self.cache_config.get("mamba_block_size"))

    @property
    def retention(self) -> str | None:
        return self.cache_config.get("prefix_cache_retention_interval")

    @property
    def plugin_modes(self) -> list[str]:
        return sorted({info.get("mode", "?") for info in self.plugin})

    def to_json(self) -> dict[str, Any]:
        return {
            "available": self.available,
            "plugin": [dict(info) for info in self.plugin],
            "cache_config": {
                key: self.cache_config[key]
                for key in (
                    "enable_prefix_caching",
                    "mamba_cache_mode",
                    "mamba_block_size",
                    "block_size",
                    "prefix_cache_retention_interval",
                )
                if key in self.cache_config
            },
            "prefix_cache_queries": self.queries,
            "prefix_cache_hits": self.hits,
            "prefix_cache_hits_by_engine": dict(self.hits_by_engine),
            "prompt_tokens": self.prompt_tokens,
            "prompt_tokens_by_engine": dict(self.prompt_tokens_by_engine),
        }


def read_metrics(text: str | None, model: str | None) -> ServerMetrics:
    """Parse one scrape; ``text`` None (no endpoint) -> ``available`` False."""
    if text is None:
        return ServerMetrics(available=False)
    plugin = tuple(
        labels for labels, value in _for_model(samples(text, INFO), model) if value == 1
    )
    configs = [labels for labels, value in samples(text, CACHE_CONFIG_INFO) if value]

    def total(name: str) -> float | None:
        found = _for_model(samples(text, name), model)
        return sum(v for _, v in found) if found else None

    def by_engine(name: str) -> dict[str, float]:
        found: dict[str, float] = {}
        for labels, value in _for_model(samples(text, name), model):
            engine = labels.get("engine", "0")
            found[engine] = found.get(engine, 0.0) + value
        return found

    return ServerMetrics(
        available=True,
        plugin=plugin,
        cache_config=configs[0] if configs else {},
        queries=total(QUERIES),
        hits=total(HITS),
        hits_by_engine=by_engine(HITS),
        prompt_tokens=total(PROMPT_TOKENS),
        prompt_tokens_by_engine=by_engine(PROMPT_TOKENS),
    )
