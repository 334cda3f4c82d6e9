"""``maintainers/onboard/table.py``'s edits of the release table and its drafted entries
(no vLLM needed): what it writes parses, says what the table means, and
changes nothing else."""

from __future__ import annotations

import ast
import zipfile
from pathlib import Path

import pytest

from maintainers import drafting
from maintainers.onboard import __main__ as procedure
from maintainers.onboard import environment, table, wheels
from vllm_mamba_align import releases
from vllm_mamba_align.checkpoints import FLASHKDA_CHUNK_SIZE
from vllm_mamba_align.releases import (
    BODIES,
    CheckpointGrid,
    InternalCheckpoint,
    PrefillRule,
    SplitBody,
)

TABLE = Path(releases.__file__).read_text()


def _entries(text: str) -> dict[str, SplitBody]:
    """Every ``_body(...)`` call of releases.py's text, evaluated."""
    namespace = {
        "_body": releases._body,
        "PrefillRule": PrefillRule,
        "InternalCheckpoint": InternalCheckpoint,
        "CheckpointGrid": CheckpointGrid,
        "FLASHKDA_CHUNK_SIZE": FLASHKDA_CHUNK_SIZE,
    }
    found = {}
    for node in ast.walk(ast.parse(text)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "_body"
        ):
            body = eval(compile(ast.Expression(node), "releases", "eval"), namespace)
            found[body.fingerprint] = body
    return found


def test_the_table_text_reads_as_the_table() -> None:
    assert list(_entries(TABLE).values()) == list(BODIES)


@pytest.mark.parametrize("body", BODIES, ids=lambda b: b.name)
def test_a_rendered_entry_evaluates_to_the_entry(body: SplitBody) -> None:
    text = table.insert_body(TABLE, drafting.render_entry(body))
    rendered = [n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Call)]
    assert len(rendered) > len(
        [n for n in ast.walk(ast.parse(TABLE)) if isinstance(n, ast.Call)]
    )
    namespace = {
        "_body": releases._body,
        "PrefillRule": PrefillRule,
        "InternalCheckpoint": InternalCheckpoint,
        "CheckpointGrid": CheckpointGrid,
        "FLASHKDA_CHUNK_SIZE": FLASHKDA_CHUNK_SIZE,
    }
    entry = drafting.render_entry(body).rstrip(",")
    assert eval(entry, namespace) == body


def test_a_release_joins_its_known_body_in_release_order() -> None:
    newest = BODIES[-1]
    edited = table.add_release_to_body(TABLE, newest.fingerprint, "0.35.0")
    after = _entries(edited)
    assert after[newest.fingerprint].releases == (*newest.releases, "0.35.0")
    assert {k: v for k, v in after.items() if k != newest.fingerprint} == {
        b.fingerprint: b for b in BODIES if b is not newest
    }
    changed = [
        line
        for line in table.text_diff(TABLE, edited, "r").splitlines()
        if line[:1] in "+-" and line[:3] not in ("+++", "---")
    ]
    assert len(changed) == 2  # one line out, one line in
    # A release listed already: no change; an older one goes first.
    assert table.add_release_to_body(edited, newest.fingerprint, "0.35.0") == edited
    shared = BODIES[1]
    older = table.add_release_to_body(TABLE, shared.fingerprint, "0.17.0")
    assert _entries(older)[shared.fingerprint].releases[0] == "0.17.0"


def test_a_drafted_body_is_appended_to_the_table() -> None:
    draft = SplitBody(
        ("0.35.0",),
        "0123456789abcdef",
        PrefillRule.BEFORE_PREFILL_END,
        InternalCheckpoint.OBSERVED,
        True,
        None,
        CheckpointGrid.CACHE_HIT_ALIGNMENT,
    )
    edited = table.insert_body(TABLE, drafting.render_entry(draft))
    after = _entries(edited)
    assert list(after.values()) == [*BODIES, draft]


def test_a_releases_string_too_long_for_its_line_is_wrapped_as_ruff_formats_it() -> (
    None
):
    """releases.py as the command edits it passes lint: a releases string past
    the line length becomes an implicit concatenation, one line each, and a
    body written on one line is rewritten one argument per line first; taking
    releases out again gives back one line."""
    tree = ast.parse(TABLE)
    short = next(
        b
        for b in BODIES
        if (call := table._body_call(tree, b.fingerprint)) is not None
        and call.lineno == call.end_lineno  # a body written on one line
    )
    text = TABLE
    added = [f"0.{minor}.{patch}" for minor in (40, 41, 42) for patch in range(4)]
    for release in added:
        text = table.add_release_to_body(text, short.fingerprint, release)
    assert max(len(line) for line in text.splitlines()) <= table.LINE_LENGTH
    entries = _entries(text)
    assert entries[short.fingerprint].releases == (*short.releases, *added)
    assert {f: b for f, b in entries.items() if f != short.fingerprint} == {
        b.fingerprint: b for b in BODIES if b is not short
    }
    call = table._body_call(ast.parse(text), short.fingerprint)
    assert call is not None and call.args[0].lineno > call.lineno  # one per line
    string = call.args[0]
    assert string.end_lineno is not None and string.end_lineno > string.lineno
    for release in added:
        text = table.remove_release(text, release)
    assert _entries(text) == {b.fingerprint: b for b in BODIES}
    string = table._body_string_node(ast.parse(text), short.fingerprint)
    assert string is not None and string.lineno == string.end_lineno


def test_seed_ranges_stretch_to_a_new_release() -> None:
    newest = releases.SEED_BODIES[-1]
    seed = drafting.SeedReading(
        newest.site, newest.fingerprint, "ab92c2fce7e1af45", True, ""
    )
    edited = table.extend_seed_ranges(TABLE, seed, "0.35.0")
    assert f'"{newest.releases.split("-")[0]}-0.35.0"' in edited
    assert '"0.29.0-0.35.0"' in edited  # _get_mamba_group_info's range


def test_a_one_release_seed_range_is_found_by_its_fingerprint() -> None:
    """0.26.0's seed range is the string "0.26.0", which is also its split
    body's releases string (earlier in the file): only the seed range moves."""
    single = next(code for code in releases.SEED_BODIES if code.releases == "0.26.0")
    seed = drafting.SeedReading(single.site, single.fingerprint, None, True, "")
    edited = table.extend_seed_ranges(TABLE, seed, "0.26.1")
    after = _entries(edited)
    assert list(after.values()) == list(BODIES)  # the split table is unchanged
    assert f'SeedCode("0.26.0-0.26.1", "{single.fingerprint}"' in edited


def test_the_table_without_a_release() -> None:
    without = drafting.table_without("0.29.0")
    assert all("0.29.0" not in b.releases for b in without)
    assert len(without) == len(BODIES) - 1  # 0.29.0 had a body of its own
    assert len(drafting.table_without("0.28.0")) == len(BODIES)  # shared body
    assert drafting.nearest_release("0.29.0", without) == "0.28.0"
    assert drafting.nearest_release("0.35.0", BODIES) == "0.34.0"
    assert drafting.nearest_release("0.14.0", BODIES) == BODIES[0].releases[0]


def test_a_bad_release_name_is_a_clear_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert procedure.main(["zero.thirty", "--no-env"]) == 2
    assert "'zero.thirty' is not a release version" in capsys.readouterr().err


@pytest.mark.parametrize("release", releases.SUPPORTED_RELEASES)
def test_forgetting_a_release_and_adding_it_back_restores_the_table(
    release: str,
) -> None:
    """``--pretend-unknown``'s starting point, then what onboarding writes."""
    body = releases.expected_body(release)
    assert body is not None
    without = table.remove_release(TABLE, release)
    entries = _entries(without)
    assert all(release not in b.releases for b in entries.values())
    if len(body.releases) == 1:
        assert body.fingerprint not in entries
        restored = table.insert_body(without, drafting.render_entry(body))
    else:
        restored = table.add_release_to_body(without, body.fingerprint, release)
    assert list(_entries(restored).values()) == list(BODIES)


def test_a_new_release_starts_from_the_nearest_pinned_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A release without a pinned file starts from the newest older release's
    stack; one older than every pinned file from the oldest (0.15.0 next to
    0.15.1's stack, not 0.33.0's, which lacks the CPU platform plugin the old
    releases need)."""
    for release in ("0.15.1", "0.20.2", "0.33.0"):
        (tmp_path / f"vllm-{release}.txt").write_text(f"# vllm=={release}\n")
    monkeypatch.setattr(environment, "ENVS", tmp_path)
    assert environment.newest_pinned("0.35.0").name == "vllm-0.33.0.txt"
    assert environment.newest_pinned("0.22.0").name == "vllm-0.20.2.txt"
    assert environment.newest_pinned("0.20.2").name == "vllm-0.15.1.txt"
    assert environment.newest_pinned("0.15.0").name == "vllm-0.15.1.txt"
    assert environment.newest_pinned().name == "vllm-0.33.0.txt"


def test_a_new_release_starts_from_the_nearest_file_meeting_its_requirements(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The requirements are read from the release's wheel: 0.20.0 pins
    apache-tvm-ffi==0.1.9, which 0.19.1's file contradicts (0.1.11) and
    0.20.2's meets; a release every file meets takes the newest older one,
    and so does one its neighbours both contradict."""
    envs = tmp_path / "envs"
    envs.mkdir()
    for release, tvm in (
        ("0.18.1", "0.1.11"),
        ("0.19.1", "0.1.11"),
        ("0.20.2", "0.1.9"),
    ):
        (envs / f"vllm-{release}.txt").write_text(
            f"# vLLM {release}\n# NODEPS: xgrammar==0.2.5\napache_tvm_ffi=={tvm}\n"
        )
    monkeypatch.setattr(environment, "ENVS", envs)

    def wheel(release: str, requirements: str) -> Path:
        path = tmp_path / f"vllm-{release}-cp38-abi3-linux_x86_64.whl"
        with zipfile.ZipFile(path, "w") as out:
            out.writestr(
                f"vllm-{release}.dist-info/METADATA",
                f"Metadata-Version: 2.1\nName: vllm\nVersion: {release}\n"
                + "".join(f"Requires-Dist: {r}\n" for r in requirements.split("|")),
            )
        return path

    strict = wheel(
        "0.20.0",
        "apache-tvm-ffi==0.1.9|xgrammar<1.0.0,>=0.1.32; platform_machine != 'none'"
        '|pytest; extra == "dev"',
    )
    template, passed_over = environment.template_for("0.20.0", strict)
    assert template.name == "vllm-0.20.2.txt"
    assert passed_over == ["`vllm-0.19.1.txt`: apache-tvm-ffi==0.1.11 (==0.1.9)"]
    loose = wheel("0.19.0", "apache-tvm-ffi>=0.1.9|xgrammar==0.2.5")
    assert environment.template_for("0.19.0", loose) == (envs / "vllm-0.18.1.txt", [])
    none_fits = wheel("0.21.0", "xgrammar==0.3.0")
    template, passed_over = environment.template_for("0.21.0", none_fits)
    assert template.name == "vllm-0.20.2.txt" and len(passed_over) == 1


def test_a_new_pinned_file_meets_the_releases_requirements() -> None:
    """An older release's pins that the new release's requirements contradict
    (0.27.0 requires apache-tvm-ffi==0.1.11, 0.26.0's file pins 0.1.10; 0.18.0
    requires xgrammar>=0.1.32, 0.17.1's pins 0.1.29) are found in ``pip
    check``'s words; packages left out on purpose, and torch (its CPU build,
    not the pinned file's), are no conflict. The pinned
    file then states the versions installed, its NODEPS line too."""
    template = (
        "# vLLM 0.17.1 scheduler stack on CPU (torch 2.13.0 CPU build), exact.\n"
        "# Installed with --no-deps after: vllm==0.17.1 and the NODEPS line.\n"
        "# NODEPS: xgrammar==0.1.29\n"
        "apache-tvm-ffi==0.1.10\n"
    )
    check = (
        "xgrammar 0.1.29 requires triton, which is not installed.\n"
        "vllm 0.18.0 has requirement torch==2.10.0, but you have torch 2.13.0.\n"
        "vllm 0.18.0 requires fastapi, which is not installed.\n"
        "vllm 0.18.0 has requirement xgrammar<1.0.0,>=0.1.32; platform_machine == "
        '"x86_64" or platform_machine == "aarch64", but you have xgrammar 0.1.29.\n'
        "vllm 0.18.0 has requirement apache-tvm-ffi==0.1.11, but you have "
        "apache-tvm-ffi 0.1.10.\n"
    )
    assert environment.vllm_conflicts(check, template) == [
        ("xgrammar<1.0.0,>=0.1.32", "xgrammar", "0.1.29"),
        ("apache-tvm-ffi==0.1.11", "apache-tvm-ffi", "0.1.10"),
    ]
    frozen = ["apache_tvm_ffi==0.1.11", "xgrammar==0.2.9", "vllm==0.18.0"]
    text = environment.pinned_text_for("0.18.0", template, frozen, "torch==2.13.0")
    assert text.splitlines()[1:] == [
        "# Installed with --no-deps after: vllm==0.18.0 and the NODEPS line.",
        "# NODEPS: xgrammar==0.2.9",
        "apache_tvm_ffi==0.1.11",
    ]


def test_a_pinned_file_names_the_test_only_plugin_its_environment_needed() -> None:
    """0.34.0's environment needed cpu_without_triton, found by trial: the pinned
    file written from 0.33.0's (which names none) says so, and a file written
    from one that names a plugin no longer needed drops its line."""
    template = (
        "# vLLM 0.33.0 scheduler stack\n"
        "# Installed with --no-deps after: vllm==0.33.0.\n"
        "pydantic==2.13.0\n"
    )
    frozen = ["pydantic==2.13.0", "vllm==0.34.0"]
    text = environment.pinned_text_for(
        "0.34.0", template, frozen, "torch==2.13.0", ["cpu_without_triton"]
    )
    assert environment._marker(text, "PLATFORM") == ["cpu_without_triton"]
    assert "tests/support/cpu_without_triton_plugin" in text
    old = template + "# PLATFORM: cpu_platform  (before 0.28.0)\n"
    text = environment.pinned_text_for("0.34.0", old, frozen, "torch==2.13.0", [])
    assert environment._marker(text, "PLATFORM") == []
    kept = environment.pinned_text_for("0.18.0", old, frozen, "torch==2.13.0")
    assert environment._marker(kept, "PLATFORM") == ["cpu_platform"]


def test_the_version_is_read_where_vllm_writes_it(tmp_path: Path) -> None:
    """vLLM's build backend writes ``vllm/_version.py``; ``version.py`` only
    imports it."""
    from maintainers import interpreters

    package = tmp_path / "vllm"
    scheduler = package / drafting.SCHEDULER_FILE
    scheduler.parent.mkdir(parents=True)
    scheduler.write_text("class Scheduler:\n    pass\n")
    (package / "version.py").write_text("from ._version import __version__\n")
    (package / "_version.py").write_text("__version__ = version = '0.34.0'\n")
    assert drafting.read_release(package).version == "0.34.0"
    assert interpreters.read_sites(package)[0] == "0.34.0"


def test_a_relabelled_wheel_is_a_valid_wheel_of_the_local_version(
    tmp_path: Path,
) -> None:
    """What ``onboard --local-version`` installs: the same files, a new version,
    a RECORD pip can read (vLLM's wheels name files with commas, which the CSV
    quotes) whose hashes match."""
    import base64
    import csv
    import hashlib
    import io

    files = {
        "vllm/_version.py": b"__version__ = version = '0.33.0'\n",
        "vllm/kernels/config,E=8,N=64.json": b"{}\n",
        "vllm-0.33.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: vllm\n"
        b"Version: 0.33.0\n",
    }
    record = io.StringIO()
    csv.writer(record, lineterminator="\n").writerows(
        [[name, "", ""] for name in files] + [["vllm-0.33.0.dist-info/RECORD", "", ""]]
    )
    wheel = tmp_path / "vllm-0.33.0-cp38-abi3-linux_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as out:
        for name, data in files.items():
            out.writestr(name, data)
        out.writestr("vllm-0.33.0.dist-info/RECORD", record.getvalue())

    labelled = wheels.relabel_wheel(wheel, "vendor1", tmp_path / "out")
    assert labelled.name == "vllm-0.33.0+vendor1-cp38-abi3-linux_x86_64.whl"
    info = "vllm-0.33.0+vendor1.dist-info"
    with zipfile.ZipFile(labelled) as contents:
        rows = list(csv.reader(contents.read(f"{info}/RECORD").decode().splitlines()))
        listed = {row[0] for row in rows}
        assert listed == set(contents.namelist())
        for name, digest, size in rows:
            if name == f"{info}/RECORD":
                continue
            data = contents.read(name)
            expected = base64.urlsafe_b64encode(hashlib.sha256(data).digest())
            assert digest == f"sha256={expected.decode().rstrip('=')}"
            assert size == str(len(data))
        assert b"Version: 0.33.0+vendor1\n" in contents.read(f"{info}/METADATA")
        assert contents.read("vllm/kernels/config,E=8,N=64.json") == b"{}\n"
    assert drafting.read_release(labelled).version == "0.33.0+vendor1"
