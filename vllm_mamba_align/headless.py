"""A refusal on a headless node, told to the head that waits for its ranks.

Why: the ranks of ``vllm serve --headless`` connect to the head's handshake
socket (``--data-parallel-address``, ``--data-parallel-rpc-port``). When the
plugin refuses a setting on such a node, that node stops before any engine core
exists, and the head's startup loop (vLLM's ``wait_for_engine_startup`` in
``vllm/v1/engine/utils.py``) waits for the missing rank without a bound, saying
so only at DEBUG: the operator looking at the head sees nothing.

How: in the main process of ``vllm serve --headless`` (no multiprocessing parent,
``--headless`` on the command line), ``register()`` hands the refusal here instead
of raising it at once. It is raised where vLLM has parsed the command line and
worked out the handshake address: when the launcher builds its engine-core
manager (``CoreEngineProcManager`` with ``local_client=False``). Before raising,
for each rank of the node one message goes to the head in the shape of vLLM's
handshake (the rank as the socket identity; ``status``, ``local``, ``headless``),
with the refusal as its status. The head's loop rejects a status it does not
know with an error that quotes it ("Unexpected <status> message for remote
engine <rank>"), so the head stops with the plugin's message in its log.
If the head is not listening within :data:`TELL_BOUND` seconds the message is
dropped and the node stops as before. Should ``run_headless`` end without
building the manager (a multi-node TP/PP node), the refusal is raised there,
untold. Every engine core and worker that still starts loads the plugin and
refuses on its own (their processes have a parent), so nothing runs unpatched.

A refusal raised later, when an engine core of a headless node builds its
scheduler (split code the plugin does not know, another plugin's layer on the
split, the stall guard), comes after that engine core's HELLO: the head holds
the rank as connected and drops a second socket with the same identity. vLLM
builds the scheduler inside its ``EngineCoreProc._perform_handshake`` context
manager, while the engine core's own handshake socket is still open (READY goes
out on it once the engine is built). :func:`tell_head_from_engine_core` finds
that suspended context manager of vLLM's at the moment of the refusal and sends
the refusal on its socket as the engine's status, which the head's loop rejects
with the same error as above. Nothing is wrapped for it: a spawned engine core
loads the plugin only after its handshake, so a wrapper would come too late.
"""

from __future__ import annotations

import gc
import importlib
import multiprocessing
import sys
import types
from typing import Any

import wrapt

from .errors import MambaAlignError

ENGINE_UTILS_MODULE = "vllm.v1.engine.utils"
ENGINE_CORE_MODULE = "vllm.v1.engine.core"
HANDSHAKE = "_perform_handshake"
SERVE_MODULE = "vllm.entrypoints.cli.serve"
MANAGER = "CoreEngineProcManager"
TELL_BOUND = 60.0
"""Seconds a refusing headless node waits for the head to take its message."""
MESSAGE_PREFIX = "vllm-mamba-align refused to start on the headless node of rank(s)"

_held: MambaAlignError | None = None


def _logger() -> Any:
    logging: Any = importlib.import_module("vllm.logger")
    return logging.init_logger("vllm.plugins.mamba_align")


def headless_launcher(argv: list[str] | None = None) -> bool:
    """Whether this process is the launcher of ``vllm serve --headless``."""
    arguments = sys.argv[1:] if argv is None else argv
    return multiprocessing.parent_process() is None and "--headless" in arguments


def on_headless_node(argv: list[str] | None = None) -> bool:
    """Whether this process belongs to ``vllm serve --headless``: its launcher,
    or an engine core or worker under it (a spawned child gets its parent's
    ``sys.argv``, a forked one keeps it)."""
    return "--headless" in (sys.argv[1:] if argv is None else argv)


def _open_handshake() -> tuple[Any, bool, bool] | None:
    """The socket, ``local`` and ``headless`` of this engine core's handshake
    with the head, while vLLM's ``_perform_handshake`` is open for a headless
    engine core (None otherwise). Looked up only when a refusal is raised: the
    suspended generator of that context manager is found among the objects the
    collector tracks, by vLLM's own code object."""
    core = sys.modules.get(ENGINE_CORE_MODULE)
    owner = getattr(core, "EngineCoreProc", None)
    function = getattr(getattr(owner, HANDSHAKE, None), "__wrapped__", None)
    code = getattr(function, "__code__", None)
    if code is None:
        return None  # no engine core here, or another vLLM layout
    for found in gc.get_objects():
        if type(found) is not types.GeneratorType or found.gi_code is not code:
            continue
        frame = found.gi_frame
        names = frame.f_locals if frame is not None else {}
        handshake_socket = names.get("handshake_socket")
        if handshake_socket is None or not names.get("headless"):
            continue
        if not handshake_socket.closed:
            return handshake_socket, bool(names.get("local_client")), True
    return None


def tell_head_from_engine_core(error: MambaAlignError, bound: float = 5.0) -> bool:
    """Send ``error`` to the head on this engine core's open handshake socket,
    as the engine's status (nothing where this is not a headless engine core
    building its engine). Returns True once the head has hung up, having taken
    the message; False when it did not within ``bound`` seconds (the message
    may still have reached it) or nothing was sent."""
    if not on_headless_node():
        return False  # no search elsewhere (a head, ``LLM``, a single node)
    found = _open_handshake()
    if found is None:
        return False
    handshake_socket, local, is_headless = found
    zmq: Any = importlib.import_module("zmq")
    msgpack: Any = importlib.import_module("msgspec.msgpack")
    rank = int.from_bytes(handshake_socket.getsockopt(zmq.IDENTITY), "little")
    payload = msgpack.encode(
        {
            "status": refusal_status(error, [rank]),
            "local": local,
            "headless": is_headless,
        }
    )
    _logger().error("%s; telling the head on the handshake socket", error)
    # The head stops on this message, closing its end: waiting for that keeps
    # the process alive until the message has left it.
    monitor = handshake_socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        handshake_socket.send(payload)
        return bool(monitor.poll(timeout=int(bound * 1000)))
    finally:
        handshake_socket.disable_monitor()
        monitor.close(linger=0)


def hold(error: MambaAlignError) -> bool:
    """Keep ``error`` to raise once the head's address is known (True), or
    leave it to the caller to raise now (False: not a headless launcher)."""
    global _held
    if not headless_launcher():
        return False
    if _held is None:
        wrapt.register_post_import_hook(_wrap_manager, ENGINE_UTILS_MODULE)
        wrapt.register_post_import_hook(_wrap_run_headless, SERVE_MODULE)
    _held = error
    return True


def held() -> MambaAlignError | None:
    """The refusal kept for the head, if any."""
    return _held


def refusal_status(error: MambaAlignError, ranks: list[int]) -> str:
    """The status the head quotes in its error."""
    return f"{MESSAGE_PREFIX} {', '.join(map(str, ranks))}: {error}"


def tell_head(
    handshake_address: str, ranks: list[int], status: str, bound: float = TELL_BOUND
) -> None:
    """Send the head one handshake-shaped message per rank, with ``status``.

    Each message goes from a socket whose identity is the rank (two bytes, little
    endian), as vLLM's engine cores identify themselves; the socket lingers at
    most ``bound`` seconds for the head to take it.
    """
    zmq: Any = importlib.import_module("zmq")
    msgpack: Any = importlib.import_module("msgspec.msgpack")
    payload = msgpack.encode({"status": status, "local": False, "headless": True})
    context = zmq.Context()
    try:
        for rank in ranks:
            socket = context.socket(zmq.DEALER)
            socket.setsockopt(zmq.IDENTITY, rank.to_bytes(2, "little"))
            socket.setsockopt(zmq.LINGER, int(bound * 1000))
            socket.connect(handshake_address)
            socket.send(payload)
            socket.close()
    finally:
        context.term()  # returns once every message is taken or its linger ran out


def _manager_wrapper(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    error = _held
    if error is None:
        wrapped(*args, **kwargs)
        return
    if kwargs.get("local_client", True) is False:
        first = int(kwargs["start_index"])
        ranks = list(range(first, first + int(kwargs["local_engine_count"])))
        address = str(kwargs["handshake_address"])
        _logger().error(
            "%s; telling the head at %s (waiting up to %.0f s for it)",
            error,
            address,
            TELL_BOUND,
        )
        tell_head(address, ranks, refusal_status(error, ranks))
    raise error


def _run_headless_wrapper(
    wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    result = wrapped(*args, **kwargs)
    if _held is not None:
        raise _held
    return result


def _wrap_manager(module: Any) -> None:
    wrapt.wrap_function_wrapper(module, f"{MANAGER}.__init__", _manager_wrapper)


def _wrap_run_headless(module: Any) -> None:
    if hasattr(module, "run_headless"):
        wrapt.wrap_function_wrapper(module, "run_headless", _run_headless_wrapper)
