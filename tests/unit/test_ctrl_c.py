"""A Ctrl-C that a library swallows still ends the command with 130.

Python raises KeyboardInterrupt wherever the main thread happens to be. Seen
with ``simulate`` importing vLLM 0.26.0: in a finalizer the interrupt is lost
(the command ran on and exited 0), and inside an import it came out as an
ImportError (the command blamed a missing plugin module). Each case here sends
a real SIGINT to this process from inside a stand-in command that swallows it
the way those libraries did.
"""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Callable, Iterator

import pytest

from vllm_mamba_align import cli
from vllm_mamba_align.cli import EXIT_INTERRUPTED, EXIT_OK, main

INTERRUPTED = "vllm-mamba-align simulate: interrupted"


@pytest.fixture
def python_s_own_sigint() -> Iterator[None]:
    """SIGINT handled by Python's own handler, as in a terminal.

    A suite started as a shell's background job (``nohup python3 -m nox &``)
    inherits SIGINT ignored, and the command rightly leaves that alone
    (test_an_ignored_sigint_stays_ignored); the cases that send a Ctrl-C need
    the handler an interactive run has."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def swallowed_then_finished() -> int:
    """A finalizer's "Exception ignored": the command carries on and succeeds."""
    with contextlib.suppress(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)
    return EXIT_OK


def swallowed_into_an_import_error() -> int:
    """An import that turned the interrupt into another error."""
    try:
        signal.raise_signal(signal.SIGINT)
    except KeyboardInterrupt:
        raise ImportError("No module named 'vllm_mamba_align.plugin'") from None
    return EXIT_OK


def reported_as_a_failure() -> int:
    """A command that caught the consequence and reported it (exit 2)."""
    try:
        swallowed_into_an_import_error()
    except ImportError as error:
        print(f"vllm-mamba-align: {error}", file=sys.stderr)
        return cli.EXIT_USAGE
    return EXIT_OK


@pytest.mark.usefixtures("python_s_own_sigint")
@pytest.mark.parametrize(
    "command",
    [swallowed_then_finished, swallowed_into_an_import_error, reported_as_a_failure],
)
def test_a_swallowed_ctrl_c_exits_130(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    command: Callable[[], int],
) -> None:
    monkeypatch.setattr(cli, "_simulate", lambda args: command())
    assert main(["simulate"]) == EXIT_INTERRUPTED
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.splitlines()[-1] == INTERRUPTED
    assert "a library swallowed it" in err.splitlines()[-2]


@pytest.mark.usefixtures("python_s_own_sigint")
def test_without_ctrl_c_the_command_answers_and_sigint_is_python_s_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cli, "_simulate", lambda args: cli.EXIT_USAGE)
    assert main(["simulate"]) == cli.EXIT_USAGE
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_ignored_sigint_stays_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    """A shell's background job ignores SIGINT: the command must not undo that."""
    seen = []
    monkeypatch.setattr(
        cli,
        "_simulate",
        lambda args: seen.append(signal.getsignal(signal.SIGINT)) or EXIT_OK,
    )
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        assert main(["simulate"]) == EXIT_OK
        assert seen == [signal.SIG_IGN]
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
