"""A refusal on a headless node reaches the head's startup loop (vLLM 0.32.0).

vLLM's own ``wait_for_engine_startup`` runs here on a bound handshake socket, as
the head runs it for one local and one remote rank; the plugin's message for
rank 1 makes it stop with the plugin's words (vllm_mamba_align/headless.py). The
whole path through ``register()`` in a headless launcher runs in a subprocess
against vLLM's real ``CoreEngineProcManager``. Both deployments, head and
headless node, run in test_distributed.py (``refused``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from typing import Any

import pytest

from vllm_mamba_align import headless
from vllm_mamba_align.errors import MambaAlignError

from .server import free_port

pytestmark = pytest.mark.xdist_group("engines")

REFUSAL = MambaAlignError("VLLM_MAMBA_ALIGN_MODE='bogus' is not a valid mode.")


def _head_socket() -> tuple[Any, Any, str]:
    import zmq

    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    address = f"tcp://127.0.0.1:{free_port()}"
    router.bind(address)
    return context, router, address


def _head_waits(router: Any, bound: float = 60) -> BaseException | None:
    """vLLM's startup loop of a head with rank 0 local and rank 1 remote; what it
    raised, or None if nothing came within ``bound`` seconds (the loop left in
    its thread)."""
    from vllm.config import CacheConfig, ParallelConfig
    from vllm.v1.engine.utils import (
        CoreEngine,
        CoreEngineLaunch,
        EngineZmqAddresses,
        wait_for_engine_startup,
    )

    parallel = ParallelConfig(data_parallel_size=2, data_parallel_size_local=1)
    launch = CoreEngineLaunch(
        engine_manager=None,
        coordinator=None,
        addresses=EngineZmqAddresses(inputs=[], outputs=[]),
        tensor_queue=None,
    )
    raised: list[BaseException] = []

    def loop() -> None:
        try:
            wait_for_engine_startup(
                router,
                [CoreEngine(0, local=True), CoreEngine(1, local=False)],
                parallel,
                False,
                CacheConfig(),
                launch,
            )
        except BaseException as error:  # what the head would die of
            raised.append(error)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    thread.join(timeout=bound)
    return raised[0] if raised else None


def test_the_head_startup_loop_stops_on_the_message_with_the_refusal() -> None:
    context, router, address = _head_socket()
    try:
        status = headless.refusal_status(REFUSAL, [1])
        headless.tell_head(address, [1], status, bound=10)
        raised = _head_waits(router)
    finally:
        router.close(linger=0)
        context.term()
    assert isinstance(raised, RuntimeError), raised
    assert "remote engine 1" in str(raised)
    assert "VLLM_MAMBA_ALIGN_MODE='bogus' is not a valid mode" in str(raised)
    assert headless.MESSAGE_PREFIX + " 1:" in str(raised)


LAUNCHER = textwrap.dedent(
    """
    import os, sys
    sys.argv = ["vllm", "serve", "MODEL", "--headless"]
    import vllm_mamba_align
    from vllm_mamba_align import headless
    vllm_mamba_align.register()  # held, not raised: a headless launcher
    assert headless.held() is not None
    from vllm.v1.engine.utils import CoreEngineProcManager
    try:
        CoreEngineProcManager(
            local_engine_count=1,
            start_index=1,
            local_start_index=0,
            vllm_config=None,
            local_client=False,
            handshake_address=os.environ["HEAD_HANDSHAKE_ADDRESS"],
            executor_class=None,
            log_stats=False,
        )
    except vllm_mamba_align.MambaAlignError as error:
        print("raised:", error)
        sys.exit(3)
    """
)


def test_a_headless_launcher_tells_the_head_then_raises_the_refusal() -> None:
    """``register()`` in the main process of ``vllm serve --headless`` with a
    refused mode: vLLM's engine-core manager, built for remote ranks, raises the
    refusal after the head's loop has received it."""
    context, router, address = _head_socket()
    env = {
        **os.environ,
        "VLLM_MAMBA_ALIGN_MODE": "bogus",
        "HEAD_HANDSHAKE_ADDRESS": address,
    }
    try:
        launcher = subprocess.Popen(
            [sys.executable, "-c", LAUNCHER],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        raised = _head_waits(router)
        output, _ = launcher.communicate(timeout=120)
    finally:
        router.close(linger=0)
        context.term()
    assert launcher.returncode == 3, output
    assert "raised: VLLM_MAMBA_ALIGN_MODE='bogus' is not a valid mode" in output
    assert isinstance(raised, RuntimeError), (raised, output)
    assert "VLLM_MAMBA_ALIGN_MODE='bogus' is not a valid mode" in str(raised)


def test_outside_a_headless_launcher_the_refusal_is_raised_at_once() -> None:
    """A child process (an engine core) or a command without ``--headless``."""
    assert not headless.headless_launcher(["serve", "MODEL"])
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            "import multiprocessing, sys\n"
            "from vllm_mamba_align import headless\n"
            "def run(q): q.put(headless.headless_launcher(['--headless']))\n"
            "if __name__ == '__main__':\n"
            "    ctx = multiprocessing.get_context('fork'); q = ctx.Queue()\n"
            "    p = ctx.Process(target=run, args=(q,)); p.start()\n"
            "    here = headless.headless_launcher(['--headless'])\n"
            "    print(here, q.get()); p.join()\n",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.stdout.split() == ["True", "False"], child.stderr


ENGINE_CORE = textwrap.dedent(
    """
    import os, sys
    import zmq
    sys.argv = ["vllm", "serve", "MODEL", *os.environ["NODE_FLAGS"].split()]
    import vllm_mamba_align
    from vllm_mamba_align import headless
    vllm_mamba_align.register()
    from vllm.v1.engine.core import EngineCoreProc
    print("handshake:", type(vars(EngineCoreProc)["startup_handshake"]).__name__)
    error = vllm_mamba_align.MambaAlignError(
        "the split is code the plugin has not verified"
    )
    address = os.environ.get("HEAD_HANDSHAKE_ADDRESS")
    if address is None:  # no handshake open: nothing to tell
        print("told:", headless.tell_head_from_engine_core(error))
        sys.exit(0)
    engine = object.__new__(EngineCoreProc)  # vLLM's handshake, as a headless
    context = zmq.Context()                   # engine core performs it
    try:
        with engine._perform_handshake(
            context, address, (1).to_bytes(2, "little"), False, True, None
        ):
            print("told:", headless.tell_head_from_engine_core(error))
            raise error  # as Scheduler.__init__ raises it: no READY follows
    except vllm_mamba_align.MambaAlignError:
        pass
    context.destroy(linger=0)
    """
)


def test_an_engine_core_of_a_headless_node_tells_the_head_after_its_hello() -> None:
    """vLLM's ``EngineCoreProc._perform_handshake`` said HELLO and got the
    head's init message; a refusal raised inside it (where vLLM builds the
    scheduler) goes on the same socket, and the head's loop stops quoting it
    (the scheduler-time refusals of test_headless_engine_refusal.py, without
    the engines). vLLM's functions stay unwrapped."""
    context, router, address = _head_socket()
    env = {**os.environ, "HEAD_HANDSHAKE_ADDRESS": address, "NODE_FLAGS": "--headless"}
    try:
        engine = subprocess.Popen(
            [sys.executable, "-c", ENGINE_CORE],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        # The engine imports vLLM first: slow on a loaded machine.
        raised = _head_waits(router, bound=240)
        router.close(linger=0)  # the head stops: its end hangs up
        output, _ = engine.communicate(timeout=120)
    finally:
        router.close(linger=0)
        context.term()
    assert engine.returncode == 0, output
    assert "handshake: staticmethod" in output
    assert "told: True" in output, output
    assert isinstance(raised, RuntimeError), (raised, output)
    assert "Unexpected " + headless.MESSAGE_PREFIX + " 1:" in str(raised)
    assert "the split is code the plugin has not verified" in str(raised)
    assert "remote engine 1" in str(raised)


def test_without_an_open_handshake_nothing_is_told() -> None:
    """A refusal in a process of a headless node where no handshake with the
    head is open (its launcher, a worker): nothing is sent."""
    engine = subprocess.run(
        [sys.executable, "-c", ENGINE_CORE],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "NODE_FLAGS": "--headless"},
    )
    assert engine.returncode == 0, engine.stdout + engine.stderr
    assert "told: False" in engine.stdout, engine.stdout
