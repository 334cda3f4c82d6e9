"""A real ``vllm serve`` (vLLM's OpenAI-compatible API server) for the e2e tests.

The server runs as ``python -m vllm.entrypoints.openai.api_server``: the ``vllm``
console script of the CPU build looks up a distribution named ``vllm`` and fails,
the module entry point does not. It binds 127.0.0.1 only, on a free port, in its
own process group (API server, engine cores and workers), so that stopping it
stops everything it started: SIGINT to the group, then SIGKILL to the group after
a bounded wait.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .models import VOCAB

SERVED_NAME = "tiny-hybrid"
API_SERVER_MODULE = ("-m", "vllm.entrypoints.openai.api_server")
VLLM_CLI = (str(Path(__file__).with_name("vllm_cli.py")), "serve")
"""``vllm serve`` itself (through tests/e2e/vllm_cli.py): the entry point of the
distributed launch modes, ``--headless`` and ``--api-server-count`` > 1."""
START_TIMEOUT = 420.0  # seconds until /health answers (2 cores, engine + drafter)
STOP_TIMEOUT = 60.0  # seconds after SIGINT before the group is killed
GROUP_EXIT_TIMEOUT = 30.0
"""Seconds the rest of the group (engine cores, DP coordinator) gets to exit once
the API server has: more than the servers' ``shutdown_timeout`` (10 s), with
room for a machine whose two cores also run test_engine's engines. A data
parallel server's engine cores took over 10 s there (quiet fresh-clone run of
7ab15e3)."""
KILLED_EXIT_TIMEOUT = 60.0
"""Seconds a SIGKILLed group gets to disappear: a data-parallel server's two
orphaned workers were still listed, in state R, 30 s after SIGKILL on 2 cores at
a load of 10-15."""


def write_tokenizer(model: Path) -> None:
    """A WordLevel tokenizer covering the model's vocabulary (``t0`` … ``t511``).

    With a tokenizer vLLM can return logprobs (``--skip-tokenizer-init`` forbids
    them); prompts are still sent as token ids.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(model / "tokenizer.json"))
    (model / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "unk_token": "t0",
                "bos_token": "t1",
                "eos_token": "t2",
                "model_max_length": 4096,
            }
        )
    )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def cli_arguments(options: dict[str, Any]) -> list[str]:
    """``{"max_model_len": 4096, "enforce_eager": True}`` -> CLI flags.

    ``True`` is a bare flag, ``False`` its ``--no-`` form (vLLM's boolean
    options), ``None`` is the literal ``None`` vLLM's parser accepts for
    optional integers, dicts are JSON.
    """
    words: list[str] = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            words.append(flag)
        elif value is False:
            words.append("--no-" + flag[2:])
        elif value is None:
            words += [flag, "None"]
        elif isinstance(value, dict):
            words += [flag, json.dumps(value)]
        else:
            words += [flag, str(value)]
    return words


class ProcessGroup:
    """A vLLM command run as the leader of a process group of its own (with
    what it starts: engine cores, workers), its output in ``log_path``."""

    def __init__(self, command: list[str], env: dict[str, str], log_path: Path) -> None:
        self.command = command
        # `-m` would put the working directory (the checkout) first on
        # sys.path: the plugin vLLM loads must be the installed wheel.
        self.env = {**os.environ, "PYTHONSAFEPATH": "1", **env}
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None
        self.stop_seconds = 0.0
        self.stopped_cleanly = False
        self.stop_report = "not stopped"

    def launch(self) -> None:
        """Start the process group without waiting for anything."""
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                self.command,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group
            )

    def stop(self) -> None:
        """SIGINT to the whole group, SIGKILL after STOP_TIMEOUT; reap."""
        if self.process is None:
            return
        self.record_stop(stop_group(self.process))

    def record_stop(self, outcome: StopOutcome) -> None:
        self.stopped_cleanly = outcome.cleanly
        self.stop_seconds = outcome.seconds
        self.stop_report = outcome.report

    def group_alive(self) -> bool:
        return self.process is not None and _group_alive(self.process.pid)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


class Server(ProcessGroup):
    """One API server process group; use as a context manager."""

    def __init__(
        self,
        model: Path,
        options: dict[str, Any],
        env: dict[str, str],
        log_path: Path,
        entry: tuple[str, ...] = API_SERVER_MODULE,
    ) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        command = [
            sys.executable,
            *entry,
            "--model",
            str(model),
            "--served-model-name",
            SERVED_NAME,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *cli_arguments(options),
        ]
        super().__init__(command, env, log_path)
        self.start_seconds = 0.0

    # -- lifetime -------------------------------------------------------------
    def __enter__(self) -> Server:
        return self.start()

    def start(self) -> Server:
        """Launch, then wait for /health (stopping the group if it never comes)."""
        started = time.monotonic()
        self.launch()
        self.wait_healthy()
        self.start_seconds = time.monotonic() - started
        return self

    def wait_healthy(self) -> Server:
        """After :meth:`launch`: wait for /health, stopping the group if it
        never comes (several servers can be launched first, then waited for)."""
        try:
            self._wait_healthy(time.monotonic() + START_TIMEOUT)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _wait_healthy(self, deadline: float) -> None:
        assert self.process is not None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(
                    f"vLLM's API server exited with {self.process.returncode} "
                    f"before answering /health:\n{self.log()[-6000:]}"
                )
            try:
                with urllib.request.urlopen(f"{self.base}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1.0)
        raise AssertionError(
            f"vLLM's API server did not answer /health within {START_TIMEOUT:.0f} s:"
            f"\n{self.log()[-6000:]}"
        )

    # -- requests ---------------------------------------------------------------
    def client(self) -> Any:
        import openai

        return openai.OpenAI(
            base_url=f"{self.base}/v1", api_key="unused", timeout=600, max_retries=0
        )

    def complete(
        self,
        prompt: list[int],
        *,
        salt: str | None = None,
        rank: int | None = None,
    ) -> Completion:
        """One ``max_tokens=1`` completion of a token-id prompt."""
        extra_body: dict[str, Any] = {"return_tokens_as_token_ids": True}
        if salt is not None:
            extra_body["cache_salt"] = salt
        headers = {} if rank is None else {"X-data-parallel-rank": str(rank)}
        response = self.client().completions.create(
            model=SERVED_NAME,
            prompt=prompt,
            max_tokens=1,
            temperature=0.0,
            logprobs=20,
            extra_body=extra_body,
            extra_headers=headers,
        )
        choice = response.choices[0]
        details = response.usage.prompt_tokens_details
        return Completion(
            cached_tokens=int(details.cached_tokens or 0) if details else -1,
            logprobs=dict(choice.logprobs.top_logprobs[0]),
        )

    def metrics(self) -> str:
        with urllib.request.urlopen(f"{self.base}/metrics", timeout=30) as r:
            return str(r.read().decode())


@dataclass
class StopOutcome:
    """How one process group's stop went, for a test's assertion message."""

    cleanly: bool
    """The leader exited within STOP_TIMEOUT of SIGINT and the rest of the group
    within GROUP_EXIT_TIMEOUT after it, nothing killed but orphaned workers
    (:func:`orphaned_workers`)."""
    seconds: float
    report: str
    """One line: when the leader exited, what had to be killed, what is left."""


def stop_group(process: subprocess.Popen[bytes]) -> StopOutcome:
    """SIGINT to the process group ``process`` leads, SIGKILL to what is left
    after bounds; reap."""
    return stop_groups([process])[0]


def stop_groups(processes: list[subprocess.Popen[bytes]]) -> list[StopOutcome]:
    """:func:`stop_group` for several groups at once (the nodes of one
    deployment): SIGINT to all first, so that no node outlives its peers'
    shutdown, then each is waited for and, past the bounds, killed."""
    started = time.monotonic()
    running = [process.poll() is None for process in processes]
    for process, alive in zip(processes, running, strict=True):
        if alive:
            _signal_group(process.pid, signal.SIGINT)
    results = []
    for process, alive in zip(processes, running, strict=True):
        group = process.pid  # start_new_session: the group id is the leader's pid
        cleanly = alive
        said = [] if alive else ["the leader had exited before SIGINT"]
        if alive:
            try:
                process.wait(timeout=max(started + STOP_TIMEOUT - time.monotonic(), 0))
                said.append(
                    f"the leader exited {time.monotonic() - started:.1f} s after SIGINT"
                )
            except subprocess.TimeoutExpired:
                cleanly = False
                said.append(f"the leader did not exit within {STOP_TIMEOUT:.0f} s")
        # Whatever is left of the group (engine cores, workers) goes too.
        deadline = time.monotonic() + GROUP_EXIT_TIMEOUT
        while _group_alive(group) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _group_alive(group):
            left = group_members(group)
            if not left or len(orphaned_workers(left)) < len(left):
                cleanly = False
            said.append(
                f"killed after {time.monotonic() - started:.1f} s: "
                + (", ".join(str(m) for m in left) or "members not readable")
            )
            _signal_group(group, signal.SIGKILL)
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)
        # Killed members that are not our children (engine cores) are gone only
        # once their parent or init reaps them: the group stays visible until
        # then (seen on a loaded 2-core machine right after SIGKILL).
        deadline = time.monotonic() + KILLED_EXIT_TIMEOUT
        while _group_alive(group) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _group_alive(group):
            said.append("still there: " + ", ".join(map(str, group_members(group))))
        seconds = time.monotonic() - started
        results.append(StopOutcome(cleanly, seconds, "; ".join(said)))
    return results


@dataclass(frozen=True)
class Member:
    """One process of a group, as /proc shows it."""

    pid: int
    parent: int
    state: str
    command: str

    def __str__(self) -> str:
        return f"{self.pid} ({self.state}) {self.command}"


def group_members(group: int) -> list[Member]:
    """Each process in ``group``, read from /proc (empty where /proc is not
    Linux's)."""
    members = []
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # The fields after the command name's closing parenthesis: state,
            # parent, process group.
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == group:
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
                text = command.decode(errors="replace").strip()[:120]
                members.append(Member(int(entry.name), int(fields[1]), fields[0], text))
    return members


ORPHAN_HELPERS = ("multiprocessing.resource_tracker",)
"""Helpers that live as long as the processes using them: the resource tracker a
worker started stays while the worker does."""


def orphaned_workers(left: list[Member]) -> list[Member]:
    """The members of ``left`` that are vLLM workers whose parent (the engine
    core) is no longer in the group, and the helpers they keep alive.

    Seen on 2 cores under e2e's load, with the default mode (``gpu-kept``) and
    with ``audit`` and data parallelism (``dp-audit``): the API server exited
    0.5-2.3 s after SIGINT, its engine cores with it, and the workers
    (``VLLM::Worker``, ``VLLM::Worker_DP0``/``_DP1``) kept running (state R) past
    GROUP_EXIT_TIMEOUT. A worker outliving its engine core is vLLM's worker
    lifecycle, whose cause inside vLLM is not known (vllm-project/vllm#34643 and
    #55510 report the class on GPUs). The plugin runs nothing there: it wraps two
    Scheduler methods, which run in the engine core. Such a worker is killed and
    named in the stop report; anything else left fails the stop.
    """
    pids = {member.pid for member in left if member.state != "Z"}
    workers = [
        m for m in left if m.command.startswith("VLLM::Worker") and m.parent not in pids
    ]
    if not workers:
        return []
    helpers = [m for m in left if any(h in m.command for h in ORPHAN_HELPERS)]
    return workers + helpers


def stop_together(*members: ProcessGroup) -> None:
    """Stop the process groups of one deployment's nodes at once."""
    launched = [m for m in members if m.process is not None]
    found = stop_groups([m.process for m in launched if m.process is not None])
    for member, outcome in zip(launched, found, strict=True):
        member.record_stop(outcome)


class Headless(ProcessGroup):
    """A ``vllm serve --headless`` node: engine cores and no API server, in a
    process group and an environment of its own; use as a context manager.

    It has no /health: entering only launches it, the head node's /health tells
    when its engines have joined.
    """

    def __init__(
        self,
        model: Path,
        options: dict[str, Any],
        env: dict[str, str],
        log_path: Path,
    ) -> None:
        command = [
            sys.executable,
            *VLLM_CLI,
            str(model),
            "--served-model-name",
            SERVED_NAME,
            "--headless",
            *cli_arguments(options),
        ]
        super().__init__(command, env, log_path)

    def __enter__(self) -> Headless:
        self.launch()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Completion:
    def __init__(self, cached_tokens: int, logprobs: dict[str, float]) -> None:
        self.cached_tokens = cached_tokens
        self.logprobs = logprobs


def max_delta(a: Completion, b: Completion) -> float:
    """Largest |Δ logprob| over the tokens both top-20 lists contain."""
    common = set(a.logprobs) & set(b.logprobs)
    assert common, (a.logprobs, b.logprobs)
    return max(abs(a.logprobs[t] - b.logprobs[t]) for t in common)


def _signal_group(group: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signum)


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


SAMPLE = re.compile(
    r"^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>[^}]*)\})? (?P<v>\S+)$"
)
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """Every sample of metric ``name`` in a Prometheus text exposition."""
    found = []
    for line in text.splitlines():
        match = SAMPLE.match(line)
        if match and match["name"] == name:
            labels = dict(LABEL.findall(match["labels"] or ""))
            found.append((labels, float(match["v"])))
    return found
