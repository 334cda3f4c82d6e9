"""The ``vllm-mamba-align`` command: ``doctor``, ``simulate`` and ``probe``.

Exit status: 0 fine; 1 ``doctor`` found that the plugin would refuse to start a
hybrid align-mode scheduler (or a setting stops vLLM at start), or ``probe``
found wrong states served (only ever from a verdict); 2 bad usage (one line
naming the option and the way out), vLLM is not installed, or ``probe`` could
not probe the server; 3 ``doctor`` found that the plugin itself cannot be
imported (a missing dependency: vLLM would only log that and run without the
fix); 4 ``doctor --strict`` found that vLLM would not load the plugin
(``VLLM_PLUGINS`` or no entry point); 6 ``doctor --strict`` found a known
vLLM defect that corrupts output with the serve settings given, where a
setting avoids it (defects.py); 5 ``probe`` cannot tell on this server
(a cached continuation differs from a fresh one by more than the server's
measured chunk-shape rounding, but not by enough to call it a wrong state); 130
interrupted (Ctrl-C), without a traceback. Under ``--json`` every exit of
``probe`` prints one JSON object. vLLM (and its torch) are imported only inside
the commands, so ``--help`` works anywhere; ``probe`` needs no vLLM at all (it
talks HTTP to a running server).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

from .errors import MambaAlignError
from .version import __version__

EXIT_OK = 0
EXIT_REFUSE = 1
EXIT_USAGE = 2
EXIT_BROKEN = 3
EXIT_NOT_LOADED = 4
EXIT_CANNOT_TELL = 5  # probe.report.EXIT_CANNOT_TELL
EXIT_CORRUPTS = 6
EXIT_INTERRUPTED = 130
"""128 + SIGINT, what a shell reports for a command ended by Ctrl-C."""
PROG = "vllm-mamba-align"


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (and, with ``--json``, a JSON one), exit 2."""

    json_errors = False

    def error(self, message: str) -> NoReturn:
        problem = f"{message} (see {self.prog} --help)"
        if self.prog == PROG:  # no command, or words no command takes
            print(self.format_usage().rstrip(), file=sys.stderr)
        print(f"{self.prog}: {problem}", file=sys.stderr)
        if self.json_errors:
            print(_failure_json(problem, EXIT_USAGE))
        sys.exit(EXIT_USAGE)


def _failure_json(problem: str, exit_code: int, url: str | None = None) -> str:
    """The JSON of a run that ended before any verdict: the keys of the
    probe's report that carry meaning without one."""
    verdict = "interrupted" if exit_code == EXIT_INTERRUPTED else "could not probe"
    return json.dumps(
        {
            "probe_version": __version__,
            "url": url,
            "exit_code": exit_code,
            "verdict": f"{verdict}: {problem}",
            "problem": problem,
        },
        indent=1,
    )


NO_VLLM = (
    "vllm-mamba-align: vLLM is not installed in this Python environment "
    "({detail}).\nInstall the plugin into the environment that runs `vllm serve` "
    "(the same python), or run this command with that environment's interpreter."
)


def _parser(json_errors: bool = False) -> argparse.ArgumentParser:
    from .settings import Mode
    from .tools.installed import CHECKPOINT_BACKEND_FILES
    from .tools.modes import STOCK
    from .tools.simulate import Scenario

    parser_class: type[_Parser] = type(
        "_Parser", (_Parser,), {"json_errors": json_errors}
    )
    parser = parser_class(
        prog=PROG,
        description="Check and demonstrate align-mode prefix caching of hybrid "
        "Mamba/GDN models in vLLM (backport of vLLM PR #54076).",
    )
    parser.add_argument("--version", action="version", version=__version__)
    commands = parser.add_subparsers(
        dest="command", required=True, parser_class=parser_class
    )

    doctor = commands.add_parser(
        "doctor",
        help="what the installed vLLM is and what the plugin will do with it",
        description="Inspect the installed vLLM (no engine, no GPU). Exits 1 exactly "
        "when the plugin would refuse to start a hybrid model in align mode.",
    )
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.add_argument(
        "--strict",
        action="store_true",
        help="also exit 4 when vLLM would not load the plugin (for image builds), "
        "and 6 when a known vLLM defect corrupts output with the serve settings "
        "given (--runner, --async-scheduling, --speculative-method) where a "
        "setting avoids it",
    )
    doctor.add_argument(
        "--runner",
        choices=("v1", "v2"),
        help="the Model Runner the engine will use (default: what vLLM picks for "
        "a hybrid model on this release and VLLM_USE_V2_MODEL_RUNNER)",
    )
    doctor.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="whether vLLM serves with async scheduling (default: on, vLLM's "
        "default with its GPU executors)",
    )
    doctor.add_argument(
        "--speculative-method",
        metavar="METHOD",
        help="the drafter's method in --speculative-config (mtp, eagle3, ngram, "
        "...), or none; not given: doctor says which defects a drafter would bring",
    )
    doctor.add_argument(
        "--scheduler-cls",
        metavar="MODULE.CLASS",
        help="judge the scheduler class vLLM is configured to build (the value "
        "of vLLM's --scheduler-cls) instead of vllm.v1.core.sched.scheduler.Scheduler",
    )
    doctor.add_argument(
        "--headless",
        action="store_true",
        help="this node runs `vllm serve --headless`: say what its engine cores "
        "do (their settings, where their metrics go)",
    )
    doctor.add_argument(
        "--ray",
        action="store_true",
        help="this process launches `vllm serve --data-parallel-backend ray`: say "
        "which settings reach the engine-core actors and whether this platform "
        "can place them",
    )

    d = Scenario()
    simulate = commands.add_parser(
        "simulate",
        help="stock vs patched vLLM scheduler, side by side, on CPU",
        description="Run the installed vLLM's real scheduler (no GPU, no weights) "
        "stock and patched on one geometry. The defaults are the geometry from the "
        "upstream report: a drafter's 816-token attention block next to a "
        "1648-token Mamba state block. vLLM's own log is off unless "
        "VLLM_LOGGING_LEVEL is set.",
    )
    simulate.add_argument(
        "--cache-block",
        type=int,
        default=d.cache_block,
        metavar="C",
        help=f"attention block, cache_config.block_size (default {d.cache_block})",
    )
    simulate.add_argument(
        "--mamba-block",
        type=int,
        default=d.state_block,
        metavar="B",
        help=f"Mamba state block, MambaSpec.block_size (default {d.state_block})",
    )
    simulate.add_argument(
        "--hash-block",
        type=int,
        default=d.hash_block,
        metavar="H",
        help=f"prefix hash block; divides C and B (default {d.hash_block})",
    )
    simulate.add_argument(
        "--prompt",
        type=int,
        default=d.prompt,
        metavar="P",
        help=f"prompt length in tokens (default {d.prompt})",
    )
    simulate.add_argument(
        "--budget",
        type=int,
        default=d.budget,
        help=f"max_num_batched_tokens per step (default {d.budget})",
    )
    simulate.add_argument(
        "--share",
        type=int,
        default=None,
        metavar="S",
        help="tokens the two sibling prompts share with the first (default "
        f"{d.share}, or half the prompt if the prompt is not longer)",
    )
    simulate.add_argument(
        "--requests",
        type=int,
        default=d.requests,
        metavar="N",
        help="distinct prompts prefilled concurrently (default 1)",
    )
    simulate.add_argument(
        "--retention",
        default="default",
        metavar="R",
        help="vLLM's prefix-cache state retention: default (what the installed "
        "vLLM uses when nothing is set: 0 on 0.29.0+), dense (every state kept) "
        "or an interval N (a multiple of the scheduler block)",
    )
    simulate.add_argument(
        "--async-scheduling",
        action="store_true",
        help="vLLM's async scheduler, one step in flight (what vLLM runs on GPU "
        "unless --no-async-scheduling is given)",
    )
    simulate.add_argument(
        "--drafter",
        metavar="METHOD:K",
        help="a speculative drafter: mtp, multi-mtp or eagle (EAGLE-3), K draft "
        "tokens per step, e.g. mtp:2 (the simulated drafts are all accepted)",
    )
    simulate.add_argument(
        "--checkpoint-backend",
        choices=list(CHECKPOINT_BACKEND_FILES),
        metavar="BACKEND",
        help="a GPU backend that writes one state inside a prefill chunk, as its "
        "layer declares it in the installed vLLM: "
        + ", ".join(CHECKPOINT_BACKEND_FILES)
        + " (default: none, as on CPU)",
    )
    choices = [STOCK, *(m.value for m in Mode)]
    simulate.add_argument(
        "--mode",
        action="append",
        choices=choices,
        help="a mode to run; repeat for several (default: stock and every plugin "
        "mode that changes scheduling, lean only when named)",
    )
    _add_probe(commands)
    return parser


def _add_probe(commands: Any) -> None:
    from .probe import judge
    from .probe import run as probe
    from .probe.preflight import MAX_THRESHOLD

    probe_parser = commands.add_parser(
        "probe",
        help="ask a running vLLM server whether it serves wrong Mamba states",
        description="Send a bounded workload to a running OpenAI-compatible vLLM "
        "server (any release, with or without this plugin) and compare each "
        "continuation from a cached prefix with a fresh run of the same prompt "
        "under a new cache_salt. By default 53 completions, one request at a "
        "time, a writer of up to 16,384 tokens (less to fit max_model_len), "
        "about 32 times its "
        "length in prompt tokens in all; the exact load is printed before the "
        "first completion, and --prompt-tokens makes it smaller. Exit 0: no "
        "difference beyond the server's own rounding; 1: wrong states served "
        "(the cases are named); 2: could not probe (why, and the way out); 5: "
        "cannot tell on this server (a difference above the server's own "
        "rounding, measured with nothing cached by prefills chunked "
        "differently, below what a wrong state is called); 130: interrupted.",
    )
    probe_parser.add_argument(
        "--url", required=True, help="the server, e.g. http://127.0.0.1:8000"
    )
    probe_parser.add_argument(
        "--model", help="served model name (default: the only one served)"
    )
    probe_parser.add_argument(
        "--api-key",
        help="vllm serve's --api-key, if set (default: $VLLM_API_KEY, which "
        "keeps it out of ps and shell history)",
    )
    probe_parser.add_argument("--json", action="store_true", help="JSON report")
    probe_parser.add_argument(
        "--timeout",
        type=float,
        default=probe.DEFAULT_TIMEOUT,
        metavar="S",
        help=f"seconds per request (default {probe.DEFAULT_TIMEOUT:g})",
    )
    probe_parser.add_argument(
        "--max-requests",
        type=int,
        default=probe.DEFAULT_MAX_REQUESTS,
        metavar="N",
        help="completions the probe may ask for, one request at a time "
        f"(default {probe.DEFAULT_MAX_REQUESTS}; fewer sibling pairs when lower)",
    )
    ranks = probe_parser.add_mutually_exclusive_group()
    ranks.add_argument(
        "--rank",
        type=int,
        default=0,
        metavar="R",
        help="the data-parallel rank (engine core) to probe: every request "
        "carries X-data-parallel-rank: R (default 0)",
    )
    ranks.add_argument(
        "--ranks",
        metavar="N|all",
        help="probe ranks 0 to N-1 in turn, each with salts and --max-requests "
        "of its own; `all`: as many as the server has (vLLM names them when "
        "refusing one 1-token request to a rank out of range); exit 1 if any "
        "rank serves a wrong state",
    )
    probe_parser.add_argument(
        "--seed", type=int, default=0, help="prompts' seed (default 0)"
    )
    probe_parser.add_argument(
        "--state-block",
        type=int,
        metavar="B",
        help="the server's Mamba state block, a multiple of 8, 16 or more (the "
        "plugin's start line names it; default: read from /metrics, else unknown)",
    )
    probe_parser.add_argument(
        "--prompt-tokens",
        type=int,
        metavar="N",
        help="the writer prompt's length (default: 16,384, or less to fit the "
        "server's max_model_len)",
    )
    probe_parser.add_argument(
        "--logprobs",
        type=int,
        default=probe.DEFAULT_LOGPROBS,
        metavar="K",
        help=f"top-k logprobs compared (default {probe.DEFAULT_LOGPROBS}; vLLM "
        "allows up to its --max-logprobs, default 20)",
    )
    probe_parser.add_argument(
        "--max-tokens",
        type=int,
        default=probe.DEFAULT_MAX_TOKENS,
        metavar="T",
        help=f"greedy tokens per request (default {probe.DEFAULT_MAX_TOKENS})",
    )
    probe_parser.add_argument(
        "--threshold",
        type=float,
        default=judge.DEFAULT_THRESHOLD,
        help="largest |delta logprob| taken as rounding, 0 to below "
        f"{MAX_THRESHOLD:g} (default {judge.DEFAULT_THRESHOLD:g}; raised to 10x "
        "the measured noise floor, and to "
        f"{judge.ROUNDING_SLACK:g}x the measured chunk-shape rounding)",
    )
    probe_parser.add_argument(
        "--rounding",
        type=float,
        metavar="X",
        help="the server's chunk-shape rounding (|delta logprob|), given instead "
        "of measured (prefills chunked differently, and decode steps where "
        "they are reproducible): 0 for kernels that "
        "are chunk-invariant (vLLM's CPU engine), or what an earlier probe of "
        "the same kernels measured",
    )


def _plugin_import_error() -> str | None:
    """Why the plugin's code (what vLLM's entry point runs) cannot be imported."""
    import importlib

    try:
        importlib.import_module(f"{__package__}.plugin")
    except ImportError as error:
        return str(error)
    return None


def _doctor(
    as_json: bool,
    strict: bool = False,
    headless: bool = False,
    ray: bool = False,
    scheduler_cls: str | None = None,
    intended: tuple[str | None, bool | None, str | None] = (None, None, None),
) -> int:
    from . import MISSING_DEPENDENCY

    broken = _plugin_import_error()
    if broken is not None:
        message = MISSING_DEPENDENCY.format(error=broken)
        print(f"vllm-mamba-align doctor: [!!] {message}", file=sys.stderr)
        if as_json:
            import json

            print(json.dumps({"plugin_importable": False, "import_error": broken}))
        return EXIT_BROKEN

    from .doctor import BadSchedulerClass, Intended, VllmMissing, collect, render_text

    # Loading vLLM's platform and plugins logs through vLLM's logger, which
    # writes to stdout: with --json, stdout carries the report alone.
    quiet = (
        contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext()
    )
    try:
        with quiet:
            report = collect(
                headless=headless,
                ray=ray,
                scheduler_cls=scheduler_cls,
                intended=Intended(*intended),
            )
    except BadSchedulerClass as bad:
        print(f"vllm-mamba-align doctor: {bad}", file=sys.stderr)
        if as_json:
            import json

            print(json.dumps({"scheduler_cls_error": str(bad)}))
        return EXIT_USAGE
    except VllmMissing as missing:
        print(NO_VLLM.format(detail=missing), file=sys.stderr)
        if as_json:
            print('{"vllm_installed": false}')
        return EXIT_USAGE
    print(report.to_json() if as_json else render_text(report))
    if report.would_refuse:
        return EXIT_REFUSE
    if strict and not report.would_load:
        return EXIT_NOT_LOADED
    if strict and report.corrupting:
        return EXIT_CORRUPTS
    return EXIT_OK


def _default_share(share: int, prompt: int) -> int:
    """The default sibling overlap, or half the prompt when that does not fit."""
    return share if share < prompt else prompt // 2


@contextlib.contextmanager
def _quiet_vllm_logs() -> Iterator[None]:
    """vLLM's log at CRITICAL for the command, unless the user set
    ``VLLM_LOGGING_LEVEL``: simulate's output is the comparison, and vLLM's
    start-up lines (and the plugin's own lines about the simulated schedulers,
    such as audit mode's warning) would read as if about the user's deployment.
    vLLM reads the variable whenever it (re)configures its logging, so it stays
    set for the run; a process that already imported vLLM (a test session) keeps
    its settings, and the environment is restored afterwards."""
    import logging
    import os

    if "vllm" in sys.modules or "VLLM_LOGGING_LEVEL" in os.environ:
        yield
        return
    # torch's "Triton not available" notice on CPU machines.
    logging.getLogger("torch._library").setLevel(logging.ERROR)
    os.environ["VLLM_LOGGING_LEVEL"] = "CRITICAL"
    try:
        yield
    finally:
        os.environ.pop("VLLM_LOGGING_LEVEL", None)


def _simulate(args: argparse.Namespace) -> int:
    from .tools.simulate import (
        Scenario,
        parse_drafter,
        parse_retention,
        render,
        simulate,
        simulated_modes,
        validate,
    )

    d = Scenario()
    try:
        retention = parse_retention(args.retention)
        drafter = None if args.drafter is None else parse_drafter(args.drafter)
    except ValueError as error:
        print(f"vllm-mamba-align simulate: {error}", file=sys.stderr)
        return EXIT_USAGE
    scenario = Scenario(
        cache_block=args.cache_block,
        state_block=args.mamba_block,
        hash_block=args.hash_block,
        prompt=args.prompt,
        budget=args.budget,
        share=_default_share(d.share, args.prompt)
        if args.share is None
        else args.share,
        requests=args.requests,
        retention=retention,
        async_scheduling=args.async_scheduling,
        drafter=drafter,
        checkpoint_backend=args.checkpoint_backend,
    )
    problems = validate(scenario)
    if problems:
        print(
            "\n  ".join(["vllm-mamba-align simulate: invalid arguments:", *problems])
            + "\n(see vllm-mamba-align simulate --help)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    with _quiet_vllm_logs():
        return _run_simulation(args, scenario, simulate, render, simulated_modes)


def _run_simulation(
    args: argparse.Namespace,
    scenario: Any,
    simulate: Any,
    render: Any,
    simulated_modes: Any,
) -> int:
    try:
        import vllm  # noqa: F401
    except ImportError as error:
        print(NO_VLLM.format(detail=error), file=sys.stderr)
        return EXIT_USAGE
    modes = list(dict.fromkeys(args.mode)) if args.mode else simulated_modes()
    try:
        results = simulate(scenario, modes)
    except MambaAlignError as error:
        print(f"vllm-mamba-align: {error}", file=sys.stderr)
        return EXIT_USAGE
    except (ValueError, AssertionError, RuntimeError) as error:
        print(
            "vllm-mamba-align: the installed vLLM rejected or could not run this "
            f"geometry: {error}",
            file=sys.stderr,
        )
        return EXIT_USAGE
    print(render(scenario, results))
    return EXIT_OK


class CtrlC:
    """Whether a Ctrl-C reached this command, even where nobody saw it.

    Python raises KeyboardInterrupt wherever the main thread is when SIGINT
    arrives. In a finalizer (``__del__``) it is printed as "Exception ignored"
    and lost, so the command runs on to exit 0; inside an import a library can
    turn it into an ImportError, so the command reports a failure that is not
    one (both seen importing vLLM 0.26.0 in ``simulate``). :func:`main` reads
    this note to answer 130 in both cases."""

    seen = False


@contextlib.contextmanager
def _noting_ctrl_c() -> Iterator[CtrlC]:
    """Note every SIGINT while the command runs, then raise KeyboardInterrupt
    as Python's own handler does. Left alone where SIGINT is not Python's
    default (ignored in a background job, or someone else's handler) or off
    the main thread (signals cannot be set there)."""
    note = CtrlC()
    previous = signal.getsignal(signal.SIGINT)
    if (
        previous is not signal.default_int_handler
        or threading.current_thread() is not threading.main_thread()
    ):
        yield note
        return

    def noted(signum: int, frame: Any) -> None:
        note.seen = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, noted)
    try:
        yield note
    finally:
        signal.signal(signal.SIGINT, previous)


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    json_wanted = "--json" in words and "probe" in words
    parser = _parser(json_errors=json_wanted)
    try:
        args = parser.parse_args(words)
    except SystemExit as done:  # --help, --version, or a usage error (said)
        return done.code if isinstance(done.code, int) else EXIT_USAGE
    with _noting_ctrl_c() as ctrl_c:
        try:
            code = _run(args)
        except KeyboardInterrupt:
            return _interrupted(args.command, json_wanted)
        except BaseException:
            if not ctrl_c.seen:
                raise
        else:
            if not ctrl_c.seen:
                return code
    # A Ctrl-C whose KeyboardInterrupt was lost on its way here.
    print(
        f"{PROG}: Ctrl-C arrived where a library swallowed it; anything "
        "reported above after that point is its consequence",
        file=sys.stderr,
    )
    return _interrupted(args.command, json_wanted)


def _run(args: argparse.Namespace) -> int:
    if args.command == "doctor":
        intended = (args.runner, args.async_scheduling, args.speculative_method)
        return _doctor(
            args.json,
            args.strict,
            args.headless,
            args.ray,
            args.scheduler_cls,
            intended,
        )
    if args.command == "probe":
        return _probe(args)
    return _simulate(args)


def _interrupted(command: str, json_wanted: bool) -> int:
    """Ctrl-C is the operator's decision, not a failure to report."""
    print(f"{PROG} {command}: interrupted", file=sys.stderr)
    if json_wanted and command == "probe":
        print(_failure_json("interrupted (Ctrl-C)", EXIT_INTERRUPTED))
    return EXIT_INTERRUPTED


def _probe_options(args: argparse.Namespace) -> Any:
    """The run's ``Options`` from the command line; BadOption names what is wrong."""
    from .probe import preflight as check
    from .probe.run import Options

    return Options(
        url=check.check_url(args.url),
        model=args.model,
        api_key=check.api_key(args.api_key, os.environ),
        timeout=check.check_timeout(args.timeout),
        max_requests=check.check_at_least_one("--max-requests", args.max_requests),
        seed=args.seed,
        logprobs=check.check_at_least_one("--logprobs", args.logprobs),
        max_tokens=check.check_at_least_one("--max-tokens", args.max_tokens),
        threshold=check.check_threshold(args.threshold),
        state_block=check.check_state_block(args.state_block),
        prompt_tokens=check.check_prompt_tokens(args.prompt_tokens),
        rounding=check.check_rounding(args.rounding),
        rank=check.check_rank(args.rank),
    )


def _probe(args: argparse.Namespace) -> int:
    from .probe import preflight as check
    from .probe.preflight import BadOption, load_line
    from .probe.progress import terminal_progress
    from .probe.report import decide, render_text, to_json

    def fail(problem: str, url: str | None) -> int:
        print(f"{PROG} probe: {problem}", file=sys.stderr)
        if args.json:
            print(_failure_json(problem, EXIT_USAGE, url))
        return EXIT_USAGE

    try:
        options = _probe_options(args)
        ranks = check.check_ranks(args.ranks)
    except BadOption as bad:
        return fail(str(bad), args.url)
    if args.ranks is not None:
        return _probe_ranks(args, options, ranks, fail)

    def announce(plan: Any) -> None:
        print(load_line(plan), file=sys.stderr, flush=True)

    try:
        with terminal_progress() as progress:
            probe = _run_probe(options, progress, announce)
        text = to_json(probe) if args.json else render_text(probe)
        code = decide(probe).exit_code
    except Exception as error:  # a bug must not read as exit 1 (wrong states)
        return fail(
            f"the probe itself failed ({type(error).__name__}: {error}): a bug in "
            "vllm-mamba-align, not a verdict on the server: please report this "
            "line with the command that gave it",
            options.url,
        )
    print(text)
    return int(code)


def _probe_ranks(args: argparse.Namespace, options: Any, count: Any, fail: Any) -> int:
    """``--ranks``: every rank in turn, one report."""
    from .probe.preflight import load_line
    from .probe.progress import terminal_progress
    from .probe.report import decide_ranks, ranks_to_json, render_ranks_text
    from .probe.run import run_ranks

    def announce(plan: Any) -> None:
        print(load_line(plan) + " (per rank)", file=sys.stderr, flush=True)

    try:
        with terminal_progress() as progress:
            found = run_ranks(options, count, progress, announce)
        text = ranks_to_json(found) if args.json else render_ranks_text(found)
        code = decide_ranks(found).exit_code
    except Exception as error:  # a bug must not read as exit 1 (wrong states)
        return int(
            fail(
                f"the probe itself failed ({type(error).__name__}: {error}): a "
                "bug in vllm-mamba-align, not a verdict on the server: please "
                "report this line with the command that gave it",
                options.url,
            )
        )
    print(text)
    return int(code)


def _run_probe(options: Any, progress: Any, announce: Any) -> Any:
    from .probe.run import run

    return run(options, progress, announce)
