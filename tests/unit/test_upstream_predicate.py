"""The upstream-fix predicate activation and ``doctor`` share.

Where vLLM's own scheduler derives ``mamba_state_block_size`` (upstream PR
#54076), the plugin stands aside; ``doctor`` says so from the same function.
"""

from __future__ import annotations

import importlib
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm_mamba_align.activation import STATE_BLOCK_ATTRIBUTE, upstream_fix_present

STOCK = """
class Scheduler:
    def __init__(self, kv_cache_config):
        self.kv_cache_config = kv_cache_config
"""
FIXED = f"""
class Scheduler:
    def __init__(self, kv_cache_config):
        self.kv_cache_config = kv_cache_config
        self.{STATE_BLOCK_ATTRIBUTE} = derive(kv_cache_config)


def derive(config):
    return 1648
"""
SUBCLASS = """
from upstream_fixed import Scheduler


class AsyncScheduler(Scheduler):
    pass
"""


@pytest.fixture
def modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    for name, source in (
        ("upstream_stock", STOCK),
        ("upstream_fixed", FIXED),
        ("upstream_async", SUBCLASS),
    ):
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in ("upstream_stock", "upstream_fixed", "upstream_async"):
        sys.modules.pop(name, None)


def test_a_scheduler_that_derives_the_state_block_is_the_upstream_fix(
    modules: Path,
) -> None:
    assert upstream_fix_present(importlib.import_module("upstream_fixed").Scheduler)
    assert not upstream_fix_present(importlib.import_module("upstream_stock").Scheduler)


def test_a_subclass_inherits_the_upstream_fix(modules: Path) -> None:
    found = importlib.import_module("upstream_async").AsyncScheduler
    assert upstream_fix_present(found)


def test_the_doctor_asks_the_same_function() -> None:
    import inspect

    from vllm_mamba_align import doctor

    source = inspect.getsource(doctor)
    # Through the decision table's facts (activation.Facts.upstream).
    assert "facts.upstream" in source and "rows_walked(" in source
    assert "ast.parse" not in source, "the doctor has no check of its own"
