"""A refusal in a headless node's engine core reaches the head (vLLM 0.32.0).

The plugin refuses some schedulers when it builds them, in the engine core,
after that engine core has said HELLO to the head: split code it does not know
(a node on another vLLM build) or another plugin's layer on the split. vLLM
then tells the head nothing, and the head's startup loop does not watch remote
engines. The plugin sends the refusal on the engine core's own handshake socket
(vllm_mamba_align/headless.py), and the head stops with it.

Each case is one deployment as in test_distributed.py, a real ``vllm serve``
head (rank 0, one API server) and a real ``vllm serve --headless`` node (rank
1): only the node has the odd split. The two deployments run side by side,
in ``nox -s e2e_headless`` (outside CI's default list: several minutes on two
cores); CI's e2e session lists them as skipped. vLLM's handshake carrying the
refusal runs in CI (test_headless_refusal.py).

- another plugin's layer: the test-only ``foreign_split`` plugin
  (tests/support/foreign_split_plugin) wraps the split with wrapt;
- unknown code: a ``sitecustomize`` on the node's ``PYTHONPATH`` swaps vLLM's
  split for its own source with one statement added, compiled from a file as a
  function of vLLM's scheduler module, before any plugin loads, as another
  vLLM build would ship it.
"""

from __future__ import annotations

import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from .geometry import PLUGIN, WORKAROUNDS
from .sessions import outside_ci
from .test_distributed import (
    REFUSAL_BOUND,
    Deployment,
    _deployments,
    _isolated,
    _stop_and_record,
    node_environment,
    two_nodes,
)

LONG_SESSION = "MAMBA_ALIGN_E2E_HEADLESS_ENGINE"
"""Set by ``nox -s e2e_headless``: run these deployments."""
pytestmark = [
    pytest.mark.xdist_group("headless-engine"),
    outside_ci(LONG_SESSION, "two head + headless deployments", "e2e_headless"),
]

HEAD_BOUND = 120.0
"""Seconds the head may take to stop once the node's engine core refused."""
FOREIGN_HEADLINE = (
    "another plugin patched vLLM's Scheduler._mamba_block_aligned_split with code "
    "the plugin has not verified"
)
UNKNOWN_HEADLINE = (
    "the installed Scheduler._mamba_block_aligned_split is code the plugin has "
    "not verified"
)
TOLD = "refused to start on the headless node of rank(s) 1"
TELLING = "telling the head on the handshake socket"

OTHER_BUILD = textwrap.dedent(
    '''
    """Test-only: this node's vLLM ships a split body no release has (the
    released one with a statement added), as another vLLM build would."""
    import ast, inspect, os, textwrap

    import wrapt

    SPLIT = "_mamba_block_aligned_split"


    def _other_build(module):
        scheduler = module.Scheduler
        tree = ast.parse(textwrap.dedent(inspect.getsource(getattr(scheduler, SPLIT))))
        tree.body[0].body.insert(0, ast.parse("another_build = True").body[0])
        path = os.path.join(os.path.dirname(__file__), "other_build_split.py")
        source = ast.unparse(tree) + "\\n"
        with open(path, "w") as handle:
            handle.write(source)
        made = {}
        exec(compile(source, path, "exec"), vars(module), made)
        setattr(scheduler, SPLIT, made[SPLIT])


    wrapt.register_post_import_hook(_other_build, "vllm.v1.core.sched.scheduler")
    '''
)


def foreign_node(root: Path) -> dict[str, str]:
    env = node_environment(None, root)
    env["VLLM_PLUGINS"] = f"{WORKAROUNDS},foreign_split,{PLUGIN}"
    env["MAMBA_ALIGN_TEST_FOREIGN_SPLIT"] = "wrapt-at-general"
    return env


def unknown_node(root: Path) -> dict[str, str]:
    site = root / "other-build"
    site.mkdir()
    (site / "sitecustomize.py").write_text(OTHER_BUILD)
    env = node_environment(None, root)
    env["PYTHONPATH"] = str(site)
    return env


CASES = {"foreign-layer": foreign_node, "unknown-code": unknown_node}


@pytest.fixture(scope="module")
def deployments(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Deployment]:
    """Both cases, started together; each waits for its node's refusal, then
    gives the head :data:`HEAD_BOUND` seconds to stop."""
    return _isolated(tmp_path_factory, "headless-engine", _run_both)


def _run_both(root: Path) -> dict[str, Deployment]:
    started = time.monotonic()
    pairs = {}
    for name, node_env in CASES.items():
        folder = root / name
        folder.mkdir()
        pairs[name] = two_nodes(
            folder,
            node_env(folder),
            {"api_server_count": 1},
            node_environment(None, folder),  # vLLM's default log level
        )
    found = {name: Deployment() for name in CASES}
    for name, deployment in found.items():
        _deployments[f"refused in the engine core ({name})"] = deployment
    refused_at: dict[str, float] = {}
    try:
        for head, node in pairs.values():
            head.launch()
            node.launch()
        # When each node's engine core refuses: its log says it tells the head.
        while len(refused_at) < len(pairs) and (
            time.monotonic() < started + REFUSAL_BOUND
        ):
            for name, (_, node) in pairs.items():
                if name not in refused_at and TELLING in node.log():
                    refused_at[name] = time.monotonic()
                    found[name].start_seconds = refused_at[name] - started
            time.sleep(1)
        for name, (head, node) in pairs.items():
            assert node.process is not None and head.process is not None
            since = refused_at.get(name, time.monotonic())
            try:
                found[name].head_exit = head.process.wait(
                    timeout=max(since + HEAD_BOUND - time.monotonic(), 1)
                )
                found[name].head_after = time.monotonic() - since
            except subprocess.TimeoutExpired:
                found[name].head_exit = None  # still waiting: the test says so
            try:
                found[name].node_exit = node.process.wait(timeout=HEAD_BOUND)
            except subprocess.TimeoutExpired:
                found[name].node_exit = None
    finally:
        for name, (head, node) in pairs.items():
            _stop_and_record(found[name], started, head, node)
    return found


@pytest.mark.parametrize(
    ("case", "reason"),
    [("foreign-layer", FOREIGN_HEADLINE), ("unknown-code", UNKNOWN_HEADLINE)],
)
def test_the_node_engine_core_refuses_after_its_hello(
    deployments: dict[str, Deployment], case: str, reason: str
) -> None:
    """The node stops by itself with the plugin's reason in its log. Its
    launcher exits 0: vLLM's ``run_headless`` returns once an engine core is
    gone (the refusal is the engine core's, not the launcher's)."""
    found = deployments[case]
    assert found.node_exit == 0, (found.node_exit, found.node_log[-3000:])
    assert reason in found.node_log, found.node_log[-3000:]
    assert "EngineCore_DP1" in found.node_log  # the engine core refused
    assert TELLING in found.node_log


@pytest.mark.parametrize(
    ("case", "reason"),
    [("foreign-layer", FOREIGN_HEADLINE), ("unknown-code", UNKNOWN_HEADLINE)],
)
def test_the_head_stops_within_the_bound_naming_the_node_and_the_reason(
    deployments: dict[str, Deployment], case: str, reason: str
) -> None:
    """The head exits non-zero within :data:`HEAD_BOUND` seconds of the node's
    refusal (its log line), its log at vLLM's default level naming rank 1 (the
    headless node) and the plugin's reason; nothing of either node is left
    running."""
    found = deployments[case]
    assert found.head_exit not in (None, 0), found.head_log[-3000:]
    assert TOLD in found.head_log, found.head_log[-3000:]
    assert "remote engine 1" in found.head_log
    assert reason in found.head_log
    assert found.left == (False, False), found.stop_reports
