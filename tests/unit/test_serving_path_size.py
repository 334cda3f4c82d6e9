"""The serving path's size (``maintainers.serving_path``): which modules
``register()`` reaches and how their code lines are counted."""

from __future__ import annotations

import textwrap

from maintainers import serving_path


def test_the_reach_is_what_register_and_a_scheduler_import() -> None:
    """The entry point's package, the split's route and the audit are reached;
    the tools, the probe, ``doctor``, the CLI and ``topology`` (only doctor
    imports it) are not (tests/test_serving_path.py records the same on a
    real scheduler)."""
    reached = set(serving_path.reached_from_register())
    assert {
        "vllm_mamba_align",
        "vllm_mamba_align.plugin",
        "vllm_mamba_align.activation",
        "vllm_mamba_align.split",
        "vllm_mamba_align.policy",
        "vllm_mamba_align.audit.counting",
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
