"""The serving path's size (``maintainers.serving_path``): which modules
``register()`` reaches and how their code lines are counted."""

from __future__ import annotations

import textwrap

from maintainers import serving_path


def test_the_reach_is_what_register_and_a_scheduler_import() -> None:
    """The entry point's package, the split's route and the audit are reached,
    and so is what only a refusal, a drafter's hazard or vLLM's worker module
    loads (the reach is an upper bound; what a lean scheduler loads is
    tests/test_serving_path.py's); the tools, the probe, ``doctor``, the CLI
    and ``topology`` (only doctor imports it) are not."""
    reached = set(serving_path.reached_from_register())
    assert {
        "vllm_mamba_align",
        "vllm_mamba_align.plugin",
        "vllm_mamba_align.activation",
        "vllm_mamba_align.split",
        "vllm_mamba_align.policy",
        "vllm_mamba_align.audit.counting",
        "vllm_mamba_align.headless",
        "vllm_mamba_align.defects",
        "vllm_mamba_align.worker_seed",
    } <= reached
    apart = ("tools", "probe", "doctor", "cli", "__main__", "topology")
    assert not [m for m in reached if m.split(".")[1:2] and m.split(".")[1] in apart]


def test_code_lines_leave_out_prose() -> None:
    """Docstrings, attribute docstrings, comments and blank lines are not
    code; a statement over several lines counts each of them."""
    source = textwrap.dedent(
        '''
        """Module docstring,
        two lines."""

        # a comment
        LIMIT = 3
        """An attribute docstring."""


        def f(a: int,
              b: int) -> int:
            """Why."""
            return a + b  # trailing comment
        '''
    )
    assert serving_path.code_lines(source) == 4


def test_the_loaded_record_is_read_from_the_childs_output() -> None:
    output = 'INFO a vLLM line\nloaded: {"fixing": true, "modules": ["a", "b"]}\n'
    assert serving_path.loaded_record(output) == {
        "fixing": True,
        "modules": ["a", "b"],
    }
