"""A network namespace holding only the loopback interface, for a Ray cluster.

Why: Ray registers a node under the machine's network address and its servers
listen on every interface, while this test machine lets servers listen on the
loopback address only; vLLM's Ray backend then looks for the DP master node
under ``node:127.0.0.1`` and finds none (``_dp_nodes_master_first`` in
``vllm/v1/engine/utils.py``). Inside a namespace whose only interface is ``lo``
the only address Ray can see is 127.0.0.1, and whatever listens there is
reachable from nowhere else. The test's own client stays outside; a
:class:`Forward` carries its connections in. Needs root (``ip netns add``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

NETNS_DIR = Path("/run/netns")


class NamespaceUnavailable(RuntimeError):
    """This machine does not let the test make a network namespace."""


class Namespace:
    """``ip netns add NAME`` with ``lo`` up; :meth:`delete` ends every process
    inside (by process id, as ``ip netns pids`` lists them) and removes it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.created = False

    def create(self) -> Namespace:
        for command in (
            ["ip", "netns", "add", self.name],
            ["ip", "-n", self.name, "link", "set", "lo", "up"],
        ):
            try:
                done = subprocess.run(
                    command, capture_output=True, text=True, timeout=30
                )
            except FileNotFoundError as missing:
                raise NamespaceUnavailable(f"no `ip` command: {missing}") from None
            if done.returncode != 0:
                if self.created:
                    self.delete()
                raise NamespaceUnavailable(
                    f"`{' '.join(command)}` exited {done.returncode}: "
                    f"{done.stderr.strip()}"
                )
            self.created = True
        return self

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside the namespace (``ip netns exec`` execs it: the
        process id stays the command's)."""
        return ["ip", "netns", "exec", self.name, *argv]

    def pids(self) -> list[int]:
        """Every process whose network namespace this is."""
        if not self.created:
            return []
        done = subprocess.run(
            ["ip", "netns", "pids", self.name],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return [int(word) for word in done.stdout.split()]

    def end_processes(self, bound: float = 30.0) -> list[str]:
        """SIGTERM every process inside, SIGKILL what is left after ``bound``
        seconds; returns ``pid command`` of each that had to be killed."""
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + bound
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.2)
        killed = []
        for pid in self.pids():
            killed.append(f"{pid} {_command_line(pid)}")
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + bound
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.2)
        return killed

    def delete(self) -> None:
        if not self.created:
            return
        subprocess.run(
            ["ip", "netns", "delete", self.name], capture_output=True, timeout=30
        )
        self.created = False

    def exists(self) -> bool:
        return (NETNS_DIR / self.name).exists()


def _command_line(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "(gone)"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()[:120]


class Forward:
    """127.0.0.1:``port`` outside the namespace, carried to 127.0.0.1:``target``
    inside it.

    The listening socket is made in the test's namespace; the thread that
    accepts then enters the other namespace (``setns`` changes the calling
    thread only), so each connection it opens to ``target`` is made there.
    """

    def __init__(self, namespace: Namespace, target: int) -> None:
        self.namespace = namespace
        self.target = target
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = int(self.listener.getsockname()[1])
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        with open(NETNS_DIR / self.namespace.name) as handle:
            os.setns(handle.fileno(), os.CLONE_NEWNET)
        while not self.closed.is_set():
            try:
                outside, _ = self.listener.accept()
            except OSError:
                return
            try:
                inside = socket.create_connection(("127.0.0.1", self.target), 30)
            except OSError:
                outside.close()
                continue
            inside.settimeout(None)
            _Connection(outside, inside)

    def close(self) -> None:
        self.closed.set()
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        self.thread.join(timeout=10)


class _Connection:
    """Bytes both ways between two sockets; both closed once both ends are done."""

    def __init__(self, a: socket.socket, b: socket.socket) -> None:
        self.sockets = (a, b)
        self.left = 2
        self.lock = threading.Lock()
        for source, sink in ((a, b), (b, a)):
            threading.Thread(
                target=self._pump, args=(source, sink), daemon=True
            ).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while chunk := source.recv(65536):
                sink.sendall(chunk)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)
        with self.lock:
            self.left -= 1
            if self.left:
                return
        for each in self.sockets:
            each.close()
