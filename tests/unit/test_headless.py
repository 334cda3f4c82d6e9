"""Where ``register()`` raises a refused setting (vllm_mamba_align/headless.py).

In the launcher of ``vllm serve --headless`` the refusal is held until vLLM
knows the head's address (the e2e tests run that path against vLLM); anywhere
else it is raised at once, as before. No vLLM here.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from vllm_mamba_align import headless
from vllm_mamba_align.errors import MambaAlignError

REGISTER = textwrap.dedent(
    """
    import sys
    sys.argv = ["vllm", *sys.argv[1:]]
    import vllm_mamba_align
    from vllm_mamba_align import headless
    try:
        vllm_mamba_align.register()
    except vllm_mamba_align.MambaAlignError as error:
        print("raised:", error)
    else:
        print("held:", headless.held())
    """
)


def _register(*argv: str) -> str:
    env = {**os.environ, "VLLM_MAMBA_ALIGN_MODE": "bogus"}
    done = subprocess.run(
        [sys.executable, "-c", REGISTER, *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_headless_launcher_holds_the_refusal_for_the_head() -> None:
    out = _register("serve", "MODEL", "--headless", "--data-parallel-start-rank", "1")
    assert out.startswith("held: VLLM_MAMBA_ALIGN_MODE='bogus' is not a valid mode")


def test_any_other_process_raises_the_refusal_at_once() -> None:
    out = _register("serve", "MODEL", "--data-parallel-size", "2")
    assert out.startswith("raised: VLLM_MAMBA_ALIGN_MODE='bogus' is not a valid mode")
    assert not headless.headless_launcher(["serve", "MODEL"])
    assert headless.hold(MambaAlignError("x")) is False  # pytest's argv


def test_the_status_the_head_quotes_names_the_ranks_and_the_refusal() -> None:
    status = headless.refusal_status(MambaAlignError("bad mode."), [2, 3])
    assert status == f"{headless.MESSAGE_PREFIX} 2, 3: bad mode."


def test_every_process_of_a_headless_node_is_recognized_by_its_command_line() -> None:
    assert headless.on_headless_node(["serve", "MODEL", "--headless"])
    assert not headless.on_headless_node(["serve", "MODEL", "--api-server-count", "2"])


def test_a_refusal_outside_a_headless_engine_core_tells_nobody() -> None:
    """No vLLM engine core here (and no handshake open): nothing to send, and
    no search through the collector's objects either without ``--headless``."""
    error = MambaAlignError("refused")
    assert headless.tell_head_from_engine_core(error) is False
