"""The ``vllm-mamba-align`` command: doctor and simulate, on the installed vLLM."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import textwrap
import time
from importlib import metadata
from pathlib import Path

import pytest
from helpers import cache_block_for, geometry_rule, run_python

from vllm_mamba_align import MambaAlignError, batch_invariance, releases, settings
from vllm_mamba_align.cli import EXIT_OK, EXIT_REFUSE, EXIT_USAGE, main
from vllm_mamba_align.tools.installed import CHECKPOINT_BACKEND_FILES

VLLM_LOG_LINE = re.compile(r"(\(\w+.*?\) )?(DEBUG|INFO|WARNING|ERROR) \d\d-\d\d ")
"""A line of vLLM's logger on stdout: "(MainProcess pid=...) INFO 11-30 ..." on
some releases, "INFO 11-30 ..." on others (0.28.0)."""

# -- doctor ----------------------------------------------------------------------


def doctor(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(["doctor", *args])
    return code, capsys.readouterr().out


def _installed_vllm() -> str:
    return str(releases.installed_version())


REFERENCE = releases.SUPPORTED_RELEASES[-1]
"""The newest verified release: doctor's exact wording is checked there."""
REFERENCE_BODY = releases.expected_body(REFERENCE)
assert REFERENCE_BODY is not None
reference_release = pytest.mark.skipif(
    _installed_vllm() != REFERENCE, reason=f"exact wording checked on {REFERENCE}"
)
upstream_geometry = pytest.mark.skipif(
    geometry_rule() != "any",
    reason="the default geometry (C=816, B=1648) starts on vLLM 0.28.0+ only",
)


def test_doctor_on_any_release(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.delenv("VLLM_MAMBA_ALIGN_MODE", raising=False)
    code, out = doctor(capsys)
    assert code == EXIT_OK, out
    assert f"vLLM            {_installed_vllm()}" in out
    assert "matches the verified body" in out


README = Path(__file__).resolve().parent.parent / "README.md"
MACHINE_LINES = re.compile(r"  (vLLM|mode|metrics) ")
"""doctor's lines that depend on where it runs (the install path, the mode and
the Prometheus set-up), left out of the README comparison."""


def _readme_doctor_sample() -> list[str]:
    text = README.read_text()
    start = text.index("vllm-mamba-align 0.1.0 doctor (Python")
    return text[start : text.index("```", start)].strip().splitlines()


@reference_release
def test_the_readme_shows_doctors_real_output(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's sample is doctor's output on the newest verified release,
    line for line, except
    for the header's Python and the lines that depend on the machine."""
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.delenv("VLLM_MAMBA_ALIGN_MODE", raising=False)
    _, out = doctor(capsys)
    real = out.strip().splitlines()
    sample = _readme_doctor_sample()
    assert re.sub(r"\(Python [\d.]+\)", "", real[0]) == re.sub(
        r"\(Python [\d.]+\)", "", sample[0]
    )
    assert [line for line in real[1:] if not MACHINE_LINES.match(line)] == [
        line for line in sample[1:] if not MACHINE_LINES.match(line)
    ]


@reference_release
def test_doctor_recognizes_the_installed_release(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.delenv("VLLM_MAMBA_ALIGN_MODE", raising=False)
    code, out = doctor(capsys)
    assert code == EXIT_OK, out
    assert f"vLLM            {REFERENCE}" in out
    assert (
        f"fingerprint {REFERENCE_BODY.fingerprint}: matches the verified body of "
        f"vLLM {REFERENCE_BODY.name}"
    ) in out
    assert "visible -> vllm_mamba_align:register" in out
    assert "VLLM_PLUGINS is unset" in out
    assert "mode            lean (the default: VLLM_MAMBA_ALIGN_MODE unset)" in out
    assert f"batch-invariant vLLM {REFERENCE} refuses batch-invariant mode" in out
    assert (
        "worker seed     patched by the plugin: vLLM 0.32.0-0.34.0's code seeds with "
        "cache_config.mamba_block_size, a wrong column when a hidden-state layer"
    ) in out
    assert "upstream fix    not present" in out
    assert (
        "verdict: [ok] a hybrid model in align mode starts with the fix active" in out
    )


@reference_release
def test_doctor_json(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_PLUGINS", "other_plugin")
    monkeypatch.setenv("VLLM_MAMBA_ALIGN_MODE", "grid")
    code, out = doctor(capsys, "--json")
    report = json.loads(out)
    assert code == EXIT_OK
    assert report["vllm_version"] == REFERENCE
    assert report["split_body"] == REFERENCE_BODY.name
    assert report["split_fingerprint"] == REFERENCE_BODY.fingerprint
    assert report["entry_point_visible"] is True
    assert report["vllm_plugins"] == "other_plugin"
    assert report["would_load"] is False
    assert report["mode"] == "grid"
    assert report["mode_is_default"] is False
    assert report["worker_seed"] == "patched"
    assert report["upstream_fix_present"] is False
    assert report["would_refuse"] is False


@reference_release
def test_doctor_json_names_the_default_mode(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VLLM_MAMBA_ALIGN_MODE", raising=False)
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    code, out = doctor(capsys, "--json")
    report = json.loads(out)
    assert code == EXIT_OK
    assert report["mode"] == "lean"
    assert report["mode_is_default"] is True
    assert report["retention_by_mode"]["lean"].startswith(
        "ends chunks where stock vLLM does and on every B boundary vLLM keeps "
        "(only replay boundaries"
    )
    assert report["retention_by_mode"]["kept"].startswith(
        "stops at every B boundary vLLM keeps (only replay boundaries"
    )
    assert "serial traffic" in report["retention_by_mode"]["full"]
    accepting = batch_invariance.mamba_backends_accepting_batch_invariance()
    exception = (
        f" other than {', '.join(accepting)} (which vLLM lets run batch-invariant)"
        if accepting
        else ""
    )
    assert report["batch_invariance"].startswith(
        f"vLLM {REFERENCE} refuses batch-invariant mode for Mamba backends{exception}: "
    )


def test_doctor_exits_1_when_the_plugin_would_refuse_unknown_code(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same table the plugin consults: forget every release and both must refuse."""
    monkeypatch.setattr(releases, "_BY_FINGERPRINT", {})
    monkeypatch.delenv("VLLM_MAMBA_ALIGN_ALLOW_UNVERIFIED", raising=False)
    code, out = doctor(capsys)
    assert code == EXIT_REFUSE, out
    assert "matches no verified release" in out
    assert "would REFUSE" in out
    assert "VLLM_MAMBA_ALIGN_ALLOW_UNVERIFIED=1" in out  # the way out, from the plugin
    # Before the server starts, doctor says what the refusal says: every way out.
    newest = releases.SUPPORTED_RELEASES[-1]
    for needed in (
        f"pip install vllm=={newest}",
        "VLLM_MAMBA_ALIGN_MODE=off",
        "`vllm-mamba-align doctor --json`",
    ):
        assert needed in out
    # Mode off runs vLLM's own split: nothing to refuse.
    monkeypatch.setenv("VLLM_MAMBA_ALIGN_MODE", "off")
    code, out = doctor(capsys)
    assert code == EXIT_OK, out
    assert "starts unchanged" in out
    monkeypatch.delenv("VLLM_MAMBA_ALIGN_MODE")
    # The opt-in makes the plugin run it (structurally compatible): doctor agrees.
    monkeypatch.setenv("VLLM_MAMBA_ALIGN_ALLOW_UNVERIFIED", "1")
    code, out = doctor(capsys)
    assert code == EXIT_OK, out
    assert "running it anyway" in out


def test_doctor_exits_1_on_a_bad_mode(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_MAMBA_ALIGN_MODE", "sideways")
    code, out = doctor(capsys)
    assert code == EXIT_REFUSE
    assert "VLLM_MAMBA_ALIGN_MODE='sideways' is not a valid mode" in out


SETTING_VALUES = {
    settings.MODE_VARIABLE: ["sideways", " FULL ", "off", ""],
    settings.AUDIT_INTERVAL_VARIABLE: ["abc", "0", "-5", "nan", "inf", "300", ""],
}
"""Values of every setting register() checks at start, bad and good ("" unset)."""


def test_every_setting_register_checks_has_values_here() -> None:
    assert len(SETTING_VALUES) == len(settings.STARTUP_CHECKS)


def _register_error() -> str | None:
    """What vLLM's plugin loader meets: the entry point's function, called."""
    (entry,) = [
        e
        for e in metadata.entry_points(group="vllm.general_plugins")
        if e.name == "mamba_align"
    ]
    try:
        entry.load()()
    except MambaAlignError as error:
        return str(error)
    return None


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        (variable, value)
        for variable, values in SETTING_VALUES.items()
        for value in values
    ],
)
def test_doctor_judges_every_setting_as_register_does(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    variable: str,
    value: str,
) -> None:
    """Whatever register() raises on stops vLLM: doctor --strict fails on it,
    with register()'s own words; whatever register() takes, doctor takes."""
    for name in SETTING_VALUES:
        monkeypatch.delenv(name, raising=False)
    if value:
        monkeypatch.setenv(variable, value)
    raised = _register_error()
    code, out = doctor(capsys, "--strict", "--json")
    report = json.loads(out)
    assert report["setting_errors"] == ([] if raised is None else [raised])
    assert (code == EXIT_REFUSE) is (raised is not None)
    assert report["would_refuse"] is (raised is not None)


def test_a_setting_that_stops_vllm_fails_doctor_strict() -> None:
    """The case as an operator meets it: vLLM's own plugin loader refuses to go
    on, and the image check (`doctor --strict`) exits non-zero, naming it."""
    bad = {settings.AUDIT_INTERVAL_VARIABLE: "abc"}
    loaded = run_python(
        "from vllm.plugins import load_general_plugins; load_general_plugins()", **bad
    )
    assert loaded.returncode != 0
    assert "VLLM_MAMBA_ALIGN_AUDIT_INTERVAL='abc'" in loaded.stderr
    checked = run_python(
        "import sys; from vllm_mamba_align.cli import main; "
        "sys.exit(main(['doctor', '--strict']))",
        **bad,
    )
    assert checked.returncode == EXIT_REFUSE, checked.stdout + checked.stderr
    assert "verdict: [!!] vLLM would NOT START" in checked.stdout
    assert "VLLM_MAMBA_ALIGN_AUDIT_INTERVAL='abc'" in checked.stdout


# -- no vLLM ----------------------------------------------------------------------

NO_VLLM = textwrap.dedent(
    """
    import sys
    sys.modules["vllm"] = None  # import vllm now fails
    from vllm_mamba_align.cli import main
    sys.exit(main({args!r}))
    """
)


@pytest.mark.parametrize("args", [["doctor"], ["doctor", "--json"], ["simulate"]])
def test_without_vllm_a_clear_message_and_exit_2(args: list[str]) -> None:
    result = run_python(NO_VLLM.format(args=args))
    assert result.returncode == 2, result.stderr
    assert "vLLM is not installed in this Python environment" in result.stderr
    assert "Traceback" not in result.stderr


BLOCKED = textwrap.dedent(
    """
    import sys
    sys.modules[{module!r}] = None  # import {module} now fails
    from vllm_mamba_align.cli import main
    sys.exit(main({args!r}))
    """
)


@pytest.mark.parametrize("module", ["wrapt", "packaging"])
@pytest.mark.parametrize("args", [["doctor"], ["doctor", "--json"]])
def test_doctor_exits_3_naming_the_cause_when_the_plugin_cannot_be_imported(
    args: list[str], module: str
) -> None:
    """vLLM only logs a plugin that fails to import; the doctor fails the build."""
    result = run_python(BLOCKED.format(module=module, args=args))
    assert result.returncode == 3, (result.stdout, result.stderr)
    assert "vllm-mamba-align cannot load in this Python" in result.stderr
    assert module in result.stderr
    assert "pip install vllm-mamba-align" in result.stderr
    assert "Traceback" not in result.stderr
    if "--json" in args:
        report = json.loads(result.stdout)
        assert report["plugin_importable"] is False
        assert module in report["import_error"]


def test_without_wrapt_vllm_plugin_loading_fails_closed_with_the_cause() -> None:
    """vLLM only logs a plugin module that fails to import, but lets an error
    raised by the registered function stop it: the package imports without
    wrapt, and register() refuses, naming the cause, through vLLM's own loader."""
    result = run_python(
        textwrap.dedent(
            """
            import sys
            sys.modules["wrapt"] = None
            from vllm.plugins import load_general_plugins
            try:
                load_general_plugins()
            except Exception as error:
                print(type(error).__name__, error)
                sys.exit(7)
            """
        ),
        VLLM_PLUGINS="mamba_align",
    )
    assert result.returncode == 7, (result.stdout, result.stderr)
    assert "MambaAlignError vllm-mamba-align cannot load" in result.stdout
    assert "wrapt" in result.stdout


def test_doctor_says_whether_metrics_reach_the_api_server(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    monkeypatch.delenv("prometheus_multiproc_dir", raising=False)
    _, out = doctor(capsys)
    assert "  metrics         " in out
    assert "PROMETHEUS_MULTIPROC_DIR is not set" in out
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "/tmp/prometheus")
    _, out = doctor(capsys, "--json")
    report = json.loads(out)
    assert report["metrics_exported"] is True
    assert "PROMETHEUS_MULTIPROC_DIR=/tmp/prometheus" in report["metrics_detail"]


FOREIGN_ASYNC = "vllm_test_foreign_split.scheduler.ForeignAsyncScheduler"
"""A stand-in written here of a platform's configured scheduler class (as
vllm-gaudi's HPUAsyncScheduler): an AsyncScheduler subclass with its own split."""


def test_doctor_judges_the_configured_scheduler_class(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--scheduler-cls`` as vLLM's: the class named is the one judged."""
    code, out = doctor(capsys, "--json", "--scheduler-cls", FOREIGN_ASYNC)
    report = json.loads(out)
    assert code == EXIT_REFUSE
    assert report["scheduler_class"] == FOREIGN_ASYNC
    assert report["refusal"].count("NOT VERIFIED") == 1
    assert (
        "ForeignAsyncScheduler overrides _mamba_block_aligned_split"
        in report["refusal"]
    )
    assert "vllm-test-foreign-split" in report["refusal"]
    vllms = "vllm.v1.core.sched.async_scheduler.AsyncScheduler"
    code, out = doctor(capsys, "--json", "--scheduler-cls", vllms)
    report = json.loads(out)
    assert code == EXIT_OK and report["would_refuse"] is False
    assert report["scheduler_class"] == vllms


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("Scheduler", "is not a dotted path module.ClassName"),
        ("no_such_package.Scheduler", "cannot be imported here"),
        ("vllm.v1.core.sched.scheduler.NoSuchClass", "cannot be imported here"),
        ("collections.OrderedDict", "is not a subclass of vLLM's Scheduler"),
    ],
)
def test_doctor_refuses_a_scheduler_class_it_cannot_judge(
    capsys: pytest.CaptureFixture[str], value: str, says: str
) -> None:
    code = main(["doctor", "--scheduler-cls", value])
    captured = capsys.readouterr()
    assert code == EXIT_USAGE
    assert captured.out == ""
    (message,) = captured.err.strip().splitlines()
    assert message.startswith(f"vllm-mamba-align doctor: --scheduler-cls {value!r}")
    assert says in message


def topology_lines(out: str) -> list[str]:
    return [line[18:] for line in out.splitlines() if line.startswith("  topology ")]


def test_doctor_on_a_headless_node_speaks_of_that_nodes_engine_cores(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What tests/e2e/test_distributed.py finds on a --headless node: its
    engine cores run its own environment's mode and no /metrics shows them."""
    _, out = doctor(capsys)
    assert topology_lines(out) == []  # not asked: nothing said
    monkeypatch.setenv(settings.MODE_VARIABLE, "full")
    code, out = doctor(capsys, "--headless")
    lines = topology_lines(out)
    assert code == EXIT_OK
    assert "this node's engine cores load the plugin" in lines[0]
    assert "(mode full)" in lines[0]
    assert "reach no /metrics" in lines[1] and len(lines) == 2
    monkeypatch.setenv(settings.MODE_VARIABLE, "bogus")
    code, out = doctor(capsys, "--headless", "--json")
    report = json.loads(out)
    assert code == EXIT_REFUSE
    assert "a setting stops them" in report["topology"][0]
    assert "sends the refusal to the head" in report["topology"][2]


def test_doctor_under_ray_names_what_vllm_copies_into_the_engine_actors(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM copies every VLLM_* variable of the launching process into an
    engine-core actor and not PROMETHEUS_MULTIPROC_DIR (vllm/ray/ray_env.py;
    tests/e2e/test_distributed.py calls that function directly)."""
    monkeypatch.setenv("VLLM_PLUGINS", "mamba_align")
    monkeypatch.setenv(settings.MODE_VARIABLE, "full")
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "/tmp/prometheus")
    code, out = doctor(capsys, "--ray")
    lines = topology_lines(out)
    assert code == EXIT_OK
    try:
        import vllm.ray.ray_env  # noqa: F401
    except ImportError:
        assert "which variables reach the engine-core actors is unknown" in lines[0]
    else:
        assert (
            "copies this process's VLLM_MAMBA_ALIGN_MODE, VLLM_PLUGINS into their "
            "environment; the plugin must be installed" in lines[0]
        )
        assert lines[1].startswith("PROMETHEUS_MULTIPROC_DIR is not copied")
        assert "set RAY_DEDUP_LOGS=0 here" in lines[2]
    from vllm.platforms import current_platform

    if getattr(current_platform, "ray_device_key", None) == "":
        assert lines[-1].startswith("[!!] vLLM's ")
        assert "cannot place data-parallel engine cores on a Ray cluster" in lines[-1]


def test_python_dash_m_runs_the_command() -> None:
    result = run_python(
        "import runpy; runpy.run_module('vllm_mamba_align', run_name='__main__')",
    )
    # No arguments: the usage, and one line saying a command is required.
    assert result.returncode == 2
    assert "usage: vllm-mamba-align" in result.stderr
    assert "{doctor,simulate,probe}" in result.stderr
    assert "Traceback" not in result.stderr


# -- simulate ----------------------------------------------------------------------


def table_row(lines: list[str], label: str) -> list[str]:
    """The cells after ``label`` in simulate's table."""
    line = next(line for line in lines if line.startswith(label))
    return line[len(label) :].split()


def chunk_ends_by_mode(lines: list[str]) -> dict[str, str]:
    at = lines.index("chunk ends of the first prompt:")
    ends = {}
    for line in lines[at + 1 :]:
        if not line.strip():
            break
        ends[line.split()[0]] = line
    return ends


@upstream_geometry
def test_simulate_dense_retention_shows_the_defect_and_the_fix(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["simulate", "--retention", "dense"]) == EXIT_OK
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "state retention dense" in out
    ends = chunk_ends_by_mode(lines)
    assert list(ends) == ["stock", "full", "kept", "grid", "lean", "audit"]
    assert ends["stock"].endswith("8160, 16320, 16752, 16764")
    assert ends["grid"].endswith("6592, 13184, 16480, 16752, 16764")
    assert "1648, 3296, 4944" in ends["full"]
    assert ends["kept"].split()[1:] == ends["full"].split()[1:], "dense: kept = full"
    assert ends["lean"].split()[1:] == ends["kept"].split()[1:], "dense: lean = kept"
    # Columns: stock, full, kept, grid, lean, audit (audit schedules as stock).
    assert table_row(lines, "B boundaries in the cache (of 10)") == [
        "0", "10", "10", "3", "10", "0",
    ]  # fmt: skip
    wrong = table_row(lines, "  ... naming a wrong state")
    assert wrong[1:5] == ["0", "0", "0", "0"] and int(wrong[0]) > 0
    assert table_row(lines, "sibling (shares 9000) reuses")[:6] == [
        "8240", "WRONG", "8240", "8240", "6592", "8240",
    ]  # fmt: skip
    assert table_row(lines, "prefill steps, first prompt") == [
        "4", "12", "12", "5", "12", "4",
    ]  # fmt: skip
    # The picture: one row per mode, stock never ends a chunk on the B grid.
    top = next(i for i, line in enumerate(lines) if line.startswith("B grid"))
    picture = {line[:8].strip(): line[8:] for line in lines[top : top + 6]}
    assert "*" not in picture["stock"] and "^" in picture["stock"]
    assert picture["full"].count("*") == 10
    ours = [line for line in lines if not VLLM_LOG_LINE.match(line)]
    assert max(len(line) for line in ours) <= 100  # vLLM's own log lines aside


def _picture_and_table(text: str) -> list[str]:
    """simulate's picture, chunk ends and table: from "B grid" to the prefill steps."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("B grid"))
    end = next(i for i, line in enumerate(lines) if line.startswith("prefill steps"))
    return [line.rstrip() for line in lines[start : end + 1]]


@reference_release
def test_the_manual_shows_simulates_real_output(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """docs/how-it-works.md's sample is `simulate`'s output with the defaults."""
    assert main(["simulate"]) == EXIT_OK
    page = (README.parent / "docs" / "how-it-works.md").read_text()
    assert _picture_and_table(page) == _picture_and_table(capsys.readouterr().out)


@upstream_geometry
def test_simulate_defaults_run_vllms_default_retention(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from vllm_mamba_align.tools.sim import Geometry, retention_interval

    assert main(["simulate"]) == EXIT_OK
    out = capsys.readouterr().out
    lines = out.splitlines()
    interval = retention_interval(Geometry(816, 1648))
    if interval is None:  # 0.28.0: vLLM's default is dense
        assert "state retention dense" in out
        return
    assert f"state retention {interval} (prefix_cache_retention_interval=" in out
    ends = chunk_ends_by_mode(lines)
    assert ends["kept"].split()[1:] == ends["grid"].split()[1:], "0: kept = grid"
    # lean: stock's chunk ends (C-aligned), then the replay boundary and the tail
    assert ends["lean"].endswith("8160, 16320, 16480, 16752, 16764")
    wrong = table_row(lines, "  ... naming a wrong state")
    assert wrong[1:5] == ["0", "0", "0", "0"] and int(wrong[0]) > 0
    # vLLM keeps the replay boundary 16,480 only: full writes 10, keeps 1.
    assert table_row(lines, "B boundaries in the cache (of 10)") == [
        "0", "1", "1", "1", "1", "0",
    ]  # fmt: skip
    # The first sibling makes vLLM keep the junction (8,240); the second reads it:
    # on stock from a block holding another position's state.
    assert table_row(lines, "second sibling (same 9000) reuses") == [
        "8240", "WRONG", "8240", "8240", "8240", "8240", "8240", "WRONG",
    ]  # fmt: skip
    assert table_row(lines, "prefill steps, first prompt") == [
        "4", "12", "5", "5", "5", "4",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--retention", "sparse", "--retention 'sparse' is not valid: use default"),
        ("--retention", "-3", "--retention '-3' is not valid"),
        ("--drafter", "medusa:2", "--drafter 'medusa:2' is not valid: use METHOD:K"),
        ("--drafter", "mtp:0", "--drafter 'mtp:0' is not valid"),
        ("--drafter", "eagle:two", "--drafter 'eagle:two' is not valid"),
    ],
)
def test_simulate_rejects_a_bad_option_value(
    option: str, value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", option, value]) == EXIT_USAGE
    assert message in capsys.readouterr().err


@upstream_geometry
def test_simulate_the_serving_default_async_scheduling_with_mtp(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """What vLLM runs on GPU for Qwen3-Next with MTP: async scheduling on."""
    from random_workloads import drafters_build

    if not drafters_build():
        pytest.skip("this vLLM cannot build a drafter's config on CPU")
    args = ["--async-scheduling", "--drafter", "mtp:2", "--retention", "dense"]
    code = main(["simulate", *args, "--mode", "stock", "--mode", "full"])
    assert code == EXIT_OK
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert (
        "With async scheduling and a drafter (mtp) proposing 2 token(s) a step "
        "(every draft accepted)." in lines
    )
    wrong = table_row(lines, "  ... naming a wrong state")
    assert wrong[1] == "0" and int(wrong[0]) > 0
    assert table_row(lines, "B boundaries in the cache (of 10)") == ["0", "10"]


@upstream_geometry
def test_simulate_reports_vllms_reason_for_an_interval_it_rejects(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from helpers import supports_retention_setting

    if not supports_retention_setting():
        pytest.skip("this vLLM has no retention setting")
    assert main(["simulate", "--retention", "1000", "--mode", "stock"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "rejected or could not run this geometry" in err
    assert "multiple of scheduler_block_size (84048)" in err


@upstream_geometry
def test_simulate_concurrent_prefills_and_chosen_modes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(
        [
            "simulate",
            "--prompt",
            "5000",
            "--share",
            "3400",
            "--requests",
            "3",
            "--mode",
            "stock",
            "--mode",
            "full",
            "--retention",
            "dense",
        ]
    )
    assert code == EXIT_OK
    out = capsys.readouterr().out
    assert "3 prompt(s) of 5000 tokens" in out
    assert "steps until all 3 prefilled" in out
    assert "  grid " not in out
    row = {line[:34].strip(): line[34:].split() for line in out.splitlines()}
    # Attention holds 3,264 of the 3,400 shared tokens (4 blocks of 816): the
    # largest B boundary within that is 1,648, which only the fix saved.
    assert row["sibling (shares 3400) reuses"] == ["0", "1648"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--mamba-block", "1650"], "--mamba-block 1650 is not a multiple of"),
        (["--cache-block", "820"], "--cache-block 820 is not a multiple of"),
        (["--budget", "0"], "--budget must be a positive number of tokens, not 0"),
        (["--prompt", "-5"], "--prompt must be a positive"),
        (["--share", "20000"], "--share must be between 0 and --prompt (16764)"),
        (["--prompt", "200000"], "--prompt must be below 131072"),
        (["--requests", "0"], "--requests must be a positive"),
    ],
)
def test_simulate_bad_geometry_is_a_clear_message(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", *args]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert message in err
    assert "invalid arguments" in err


@pytest.mark.parametrize(
    "args", [["--budget", "lots"], ["--mode", "sideways"], ["--prompt"]]
)
def test_simulate_unparseable_arguments_exit_2(
    args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", *args]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("vllm-mamba-align simulate: argument ")
    assert err.endswith(" (see vllm-mamba-align simulate --help)\n")
    assert len(err.splitlines()) == 1


@upstream_geometry
def test_simulate_short_prompt_default_share_fits(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["simulate", "--prompt", "4000", "--mode", "stock"]) == EXIT_OK
    assert "siblings sharing its first 2000 tokens" in capsys.readouterr().out


def test_the_oracle_names_prefix_states_in_linear_time_identically() -> None:
    from vllm_mamba_align.tools.sim import prefix_state_ids, prompt, state_id

    tokens = prompt(1000, seed=3)
    ids = list(prefix_state_ids(tokens, 16))
    assert len(ids) == 1000 // 16
    assert ids == [state_id(tokens, (k + 1) * 16) for k in range(len(ids))]


def test_doctor_classifies_the_worker_seed_with_the_plugins_fingerprints() -> None:
    """From the source file's syntax tree, never importing GPU code: the same
    answer as the plugin's classification of the live class."""
    import importlib

    import vllm

    from vllm_mamba_align.doctor import worker_seed_status
    from vllm_mamba_align.releases import MODEL_STATE, WORKER_MODULE, SeedSite
    from vllm_mamba_align.worker_seed import classify

    try:
        model_state = getattr(importlib.import_module(WORKER_MODULE), MODEL_STATE)
    except (ImportError, AttributeError):
        model_state = None
    site = classify(model_state)
    root = Path(vllm.__file__).parent
    status, detail = worker_seed_status(root, "full")
    expected = {
        SeedSite.SEEDS_WITH_CACHE_BLOCK: "patched",
        SeedSite.SEEDS_WITH_MAMBA_BLOCK: "patched",
        SeedSite.ABSENT: "absent",
        SeedSite.UNRECOGNIZED: "unknown",
    }
    assert status == expected[site], detail
    if status == "patched":  # 0.25.1+
        assert detail.startswith("patched by the plugin: vLLM ")
        assert worker_seed_status(root, "off")[0] == "affected"


def test_ctrl_c_during_simulate_exits_130_without_a_traceback(tmp_path: Path) -> None:
    """A real SIGINT while simulate imports vLLM or runs its schedulers (32
    concurrent prompts: tens of seconds), as a terminal's Ctrl-C sends it.

    The geometry is one the installed vLLM starts with: a release that refuses
    the default one (0.26.0 hashes at the LCM of unequal blocks and fails its
    own check) exits 2 at once, on a quiet machine before the signal."""
    command = [sys.executable, "-m", "vllm_mamba_align", "simulate"]
    # Hash block 8 divides every release's cache block: 816, 824 (B / 2), 1648.
    blocks = ["--cache-block", str(cache_block_for(1648)), "--hash-block", "8"]
    running = subprocess.Popen(
        [*command, "--requests", "32", *blocks],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        # A shell's background job ignores SIGINT, and children inherit that.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    time.sleep(3)
    running.send_signal(signal.SIGINT)
    out, err = running.communicate(timeout=120)
    # 130, or the same status a shell sees (128 + 2) when CPython re-raises the
    # signal at exit: it does so when a KeyboardInterrupt crossed its own code
    # while importing (torch's import), after main() returned 130.
    assert running.returncode in (130, -signal.SIGINT), out + err
    assert "Traceback" not in err
    assert err.splitlines()[-1] == "vllm-mamba-align simulate: interrupted"


@pytest.mark.parametrize("backend", list(CHECKPOINT_BACKEND_FILES))
def test_simulate_knows_every_checkpoint_backend_vllm_declares(
    backend: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--checkpoint-backend``: every backend of the release table's list, run
    where the installed vLLM's layer declares checkpoint blocks for it (read
    from its files; 0.34.0: all six, among them GLM-5-Next's and Kimi-K3 AMD's
    KDA and Qwen4Exp's PLE layer), refused with the list it does declare
    elsewhere. B = 256, a 2,312-token prompt: the backend's state at 2,304 is
    the re-ask's."""
    from vllm_mamba_align.releases import installed_version
    from vllm_mamba_align.tools.sim import available_checkpoint_backends

    geometry = ["--cache-block", "16", "--mamba-block", "256", "--hash-block", "16"]
    args = [*geometry, "--prompt", "2312", "--budget", "1500"]
    args += ["--checkpoint-backend", backend, "--mode", "kept"]
    code = main(["simulate", *args])
    captured = capsys.readouterr()
    if backend not in available_checkpoint_backends():
        assert code == EXIT_USAGE
        assert f"vLLM {installed_version()} declares no prefill" in captured.err
        return
    assert code == EXIT_OK, captured.err
    lines = captured.out.splitlines()
    assert f"With the {backend} backend's in-chunk prefill checkpoint." in lines
    assert table_row(lines, "  ... naming a wrong state") == ["0"]
    assert table_row(lines, "re-ask reuses (last B boundary 2304)") == ["2304"]
