"""``vllm-mamba-align probe --ranks all`` against a two-node deployment.

The deployment of ``test_distributed.py`` (rank 0 on a head node with the API
server, rank 1 on a headless node, one process group and environment each, the
model and geometry of ``test_serve.py``: C = 8 < B = 32, the drafter, every
state kept), with stock scheduling (``VLLM_MAMBA_ALIGN_MODE=off``) on the
headless node and the default mode on the head's. The head's ``/metrics`` shows
rank 0 only, so the probe cannot count the ranks there: it asks the server, one
1-token request to a rank out of range, which vLLM refuses naming the range.

The claim: probed at the head's URL, as an operator runs it, with no
``--rounding``, the probe checks both ranks in turn, each under salts of its
own, passes rank 0, and exits 1 naming rank 1 and the cases it served wrong.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from .probe_run import ProbeRun, run_probe
from .test_distributed import (
    Deployment,
    _deployments,
    _isolated,
    _stop_and_record,
    node_environment,
    two_nodes,
)

pytestmark = pytest.mark.xdist_group("distributed")

HEAD_MODE = None  # the default mode (kept)
HEADLESS_MODE = "off"  # stock scheduling


@pytest.fixture(scope="module")
def stock_on_rank1(tmp_path_factory: pytest.TempPathFactory) -> Deployment:
    """The fix on rank 0 (head), stock on rank 1 (headless), probed once."""
    return _isolated(tmp_path_factory, "stock-on-rank1", _run)


def _run(root: Path) -> Deployment:
    head, node = two_nodes(
        root,
        node_environment(HEADLESS_MODE, root),
        {},
        node_environment(HEAD_MODE, root),
    )
    # Listed with test_distributed's deployments (its summary line: the cost).
    found = _deployments["probe-ranks"] = Deployment()
    started = time.monotonic()
    try:
        node.launch()
        head.start()
        found.start_seconds = time.monotonic() - started
        found.probe = run_probe(head.base, "--ranks", "all")
    finally:
        _stop_and_record(found, started, head, node)
    return found


def test_the_probe_checks_every_rank_and_names_the_one_serving_wrong_states(
    stock_on_rank1: Deployment,
) -> None:
    probe = stock_on_rank1.probe
    assert isinstance(probe, ProbeRun)
    report = probe.report
    assert probe.exit_code == 1, report["verdict"]
    assert report["ranks_count"] == 2, report["ranks_source"]
    assert "out of range [0, 2)" in report["ranks_source"]
    assert report["verdict"].startswith("rank 1 of 2: [!!] wrong states served: ")
    head, headless = report["ranks"]
    assert (head["rank"], headless["rank"]) == (0, 1)
    assert head["salt_prefix"] != headless["salt_prefix"]
    # Rank 0, the fix: cached states read, none wrong.
    assert head["exit_code"] == 0, head["verdict"]
    assert any(case["cached_tokens"] for case in head["cases"])
    # Rank 1, stock: the cases it served wrong, each having read a cached state,
    # judged against a rounding the probe measured (no --rounding).
    assert headless["exit_code"] == 1, headless["verdict"]
    assert headless["rounding_given"] is False and headless["rounding_measured"]
    diverged = [c for c in headless["cases"] if c["verdict"] == "DIVERGED"]
    assert diverged, headless["cases"]
    assert all(case["cached_tokens"] > 0 for case in diverged)
    for case in diverged:
        assert case["name"] in report["verdict"]
    # Each rank's probe within its own bound, stated once per rank.
    for rank in (head, headless):
        assert rank["requests_sent"] == rank["workload"]["requests"] <= 53
    assert probe.stderr.count("(per rank)") == 2
    assert all(stock_on_rank1.stopped_cleanly), stock_on_rank1.stop_reports
    assert not any(stock_on_rank1.left)
