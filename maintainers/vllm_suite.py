"""vLLM's own scheduler tests as a judge of the plugin (`nox -s vllm_suite`).

A vLLM release's source distribution holds its tests; ``tests/v1/core`` drives the
scheduler, prefix caching and the Mamba align split on the CPU scheduler stack.
This module does the four jobs around running them, stock and with the plugin in
each mode, and says whether the plugin changed any test's outcome:

- ``fetch``: the release's sdist from the index pip is configured with (its simple
  API lists the file and its hash; ``pip download`` cannot fetch it, because pip
  builds the sdist's metadata first, which needs vLLM's build requirements);
- ``extract``: its tests and the ``pyproject.toml`` that configures pytest for them;
- ``hf-cache``: an offline Hugging Face cache with only the ``config.json`` files
  the tests read, written by transformers' own config classes (runs in the
  release's environment);
- ``compare``: the junit XML of each run against stock's.

It is also the pytest plugin each run loads with ``-p vllm_suite``: with
``MAMBA_ALIGN_SUITE_REGISTER=1`` it calls ``vllm_mamba_align.register()`` before
collection, as vLLM's plugin loader would in a server. Never shipped in the wheel,
never imported on the serving path.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import urllib.parse
import urllib.request
import xml.etree.ElementTree as ElementTree
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

STOCK = "stock"
"""The run without the plugin registered: every mode's run is compared with it."""

EXCEPTIONS: dict[str, str] = {
    "tests.v1.core.test_kv_cache_planning::test_is_kv_cache_spec_uniform": (
        "runs `python -O` importing vLLM with a 60 s timeout: on a loaded machine it "
        "times out in some runs and not others, stock included"
    ),
}
"""Tests whose outcome may differ from stock's for a known reason other than a
defect of the plugin (a change it makes on purpose, a test that depends on the
machine's load): test id -> why. A listed test is reported when it changes,
never counted as a change."""

TEST_FOLDERS = ("tests/v1/core/",)
"""What runs: vLLM's scheduler, prefix-caching and KV-cache-manager tests."""
SUPPORT_NAMES = ("__init__.py", "utils.py")
"""What those tests import besides themselves: vLLM's test helpers are the
``utils.py`` modules of its test packages (``tests.utils``,
``tests.v1.kv_connector.unit.utils``, ...); every one of them is taken."""

HF_MODELS: dict[str, tuple[str, dict[str, object]]] = {
    "facebook/opt-125m": (
        "OPTConfig",
        {"hidden_size": 768, "num_attention_heads": 12, "num_hidden_layers": 12},
    ),
    "facebook/opt-350m": (
        "OPTConfig",
        {
            "hidden_size": 1024,
            "num_attention_heads": 16,
            "num_hidden_layers": 24,
            "ffn_dim": 4096,
            "word_embed_proj_dim": 512,
        },
    ),
    "llava-hf/llava-1.5-7b-hf": ("LlavaConfig", {}),
    "Qwen/Qwen3-Next-80B-A3B-Instruct": ("Qwen3NextConfig", {}),
    "Qwen/Qwen3-0.6B": (
        "Qwen3Config",
        {
            "hidden_size": 1024,
            "intermediate_size": 3072,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "max_position_embeddings": 40960,
            "tie_word_embeddings": True,
        },
    ),
    "Qwen/Qwen1.5-7B": ("Qwen2Config", {"max_position_embeddings": 32768}),
    "Qwen/Qwen2.5-VL-3B-Instruct": (
        "Qwen2_5_VLConfig",
        {
            "text_config": {
                "hidden_size": 2048,
                "intermediate_size": 11008,
                "num_hidden_layers": 36,
                "num_attention_heads": 16,
                "num_key_value_heads": 2,
            }
        },
    ),
    "Qwen/Qwen3.5-0.8B": ("Qwen3_5Config", {}),
    "hmellor/tiny-random-LlamaForCausalLM": (
        "LlamaConfig",
        {
            "hidden_size": 16,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
        },
    ),
}
"""The models the tests name, offline: transformers' config class (whose
defaults are the model's where no value is given) and the values that differ,
read from each model's published configuration. A class this release's
transformers lacks is left out; its tests fail alike in every run."""


# -- the pytest plugin ------------------------------------------------------------


TEST_PLUGINS_VARIABLE = "MAMBA_ALIGN_TEST_PLATFORM_PLUGINS"


def register_environment_plugins() -> list[str]:
    """Call the test-only general plugins the environment names (its pinned
    file's ``# PLATFORM:`` line, passed as :data:`TEST_PLUGINS_VARIABLE`): on
    0.34.0, ``cpu_without_triton``, without which vLLM's CPU platform refuses
    every config on x86 (no triton-cpu on the registry). They belong to the
    environment, not to the plugin under judgment: every run, stock included,
    gets them. vLLM's tests build configs without its plugin loader."""
    from importlib.metadata import entry_points

    wanted = {n for n in os.environ.get(TEST_PLUGINS_VARIABLE, "").split(",") if n}
    called = []
    for entry in entry_points(group="vllm.general_plugins"):
        if entry.name in wanted:
            entry.load()()
            called.append(entry.name)
    return called


def pytest_configure(config: object) -> None:
    """The environment's test-only plugins, then the plugin for this run when
    the session asks for it."""
    register_environment_plugins()
    if os.environ.get("MAMBA_ALIGN_SUITE_REGISTER") == "1":
        import vllm_mamba_align

        vllm_mamba_align.register()


# -- the release's tests ----------------------------------------------------------


def index_url() -> str:
    """The index pip installs from here: its environment variable, its
    configuration, or its built-in default, in pip's own order."""
    if os.environ.get("PIP_INDEX_URL"):
        return os.environ["PIP_INDEX_URL"]
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        if key.endswith(".index-url"):
            return value.strip("'\"")
    from pip._internal.models.index import PyPI

    return str(PyPI.simple_url)


def fetch(release: str, cache: Path) -> Path:
    """vLLM ``release``'s sdist in ``cache``, downloaded once, its hash checked
    against the one the index lists."""
    name = f"vllm-{release}.tar.gz"
    target = cache / name
    if target.exists():
        return target
    project = urllib.parse.urljoin(index_url().rstrip("/") + "/", "vllm/")
    request = urllib.request.Request(
        project, headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(request) as answer:
        files = json.load(answer)["files"]
    (listed,) = [f for f in files if f["filename"] == name]
    cache.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".part")
    digest = hashlib.sha256()
    with (
        urllib.request.urlopen(urllib.parse.urljoin(project, listed["url"])) as body,
        partial.open("wb") as out,
    ):
        while chunk := body.read(1 << 20):
            digest.update(chunk)
            out.write(chunk)
    expected = listed.get("hashes", {}).get("sha256")
    if expected and digest.hexdigest() != expected:
        partial.unlink()
        raise SystemExit(f"{name}: sha256 {digest.hexdigest()}, index says {expected}")
    partial.rename(target)
    return target


def extract(sdist: Path, dest: Path) -> None:
    """The tests (:data:`TEST_FOLDERS`), the test helpers (:data:`SUPPORT_NAMES`)
    and the ``pyproject.toml`` that configures pytest (its markers) into
    ``dest``, paths relative to the sdist's top folder."""
    with tarfile.open(sdist) as archive:
        for member in archive.getmembers():
            _, _, path = member.name.partition("/")
            wanted = (
                path == "pyproject.toml"
                or path.startswith(TEST_FOLDERS)
                or (path.startswith("tests/") and Path(path).name in SUPPORT_NAMES)
            )
            if member.isfile() and wanted:
                member.name = path
                archive.extract(member, dest, filter="data")


def write_hf_cache(home: Path) -> None:
    """A Hugging Face hub cache in ``home`` with each of :data:`HF_MODELS`:
    its ``config.json`` and a tiny tokenizer (the scheduler's structured-output
    manager loads one; no test reads its vocabulary)."""
    import transformers
    from tokenizers import Tokenizer, models

    revision = "0" * 40
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
    )
    for model, (name, values) in HF_MODELS.items():
        config_class = getattr(transformers, name, None)
        if config_class is None:
            continue
        repo = home / "hub" / ("models--" + model.replace("/", "--"))
        snapshot = repo / "snapshots" / revision
        snapshot.mkdir(parents=True, exist_ok=True)
        config_class(**values).save_pretrained(snapshot)
        tokenizer.save_pretrained(snapshot)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(revision)


# -- the comparison ---------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """One test's result in one run: ``passed``, ``failed`` (an error too),
    ``skipped`` (xfail too), or ``missing`` (not collected in that run)."""

    status: str
    message: str = ""


def read_junit(path: Path) -> dict[str, Outcome]:
    """Each test's outcome in a junit XML file, by ``module.Class::name``."""
    outcomes = {}
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        test = f"{case.get('classname', '')}::{case.get('name', '')}"
        status, message = "passed", ""
        for tag, meaning in (("failure", "failed"), ("error", "failed")):
            found = case.find(tag)
            if found is not None:
                status, message = meaning, found.get("message", "")
                break
        else:
            if case.find("skipped") is not None:
                status = "skipped"
        outcomes[test] = Outcome(status, message)
    return outcomes


def junit_seconds(path: Path) -> float:
    """The run's wall time as pytest records it (collection included)."""
    return sum(
        float(suite.get("time", 0))
        for suite in ElementTree.parse(path).getroot().iter("testsuite")
    )


@dataclass
class ModeResult:
    """One run's counts and the tests whose outcome differs from stock's."""

    mode: str
    seconds: float = 0.0
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    changed: dict[str, tuple[Outcome, Outcome]] = field(default_factory=dict)
    excepted: dict[str, tuple[Outcome, Outcome]] = field(default_factory=dict)


@dataclass
class Verdict:
    """Every run against stock: what changed, what is excepted, and the
    failures shared by stock and every mode (the environment's, not the
    plugin's)."""

    results: list[ModeResult]
    shared_failures: dict[str, str]

    @property
    def changed(self) -> int:
        return sum(len(result.changed) for result in self.results)


def compare(
    runs: Mapping[str, Mapping[str, Outcome]],
    exceptions: Mapping[str, str] = EXCEPTIONS,
) -> Verdict:
    """Each mode's outcomes (``runs``, keyed by mode, :data:`STOCK` among them)
    against stock's, test by test."""
    stock = runs[STOCK]
    results = []
    for mode, outcomes in runs.items():
        result = ModeResult(mode)
        for test in sorted(stock.keys() | outcomes.keys()):
            own = outcomes.get(test, Outcome("missing"))
            if own.status in ("passed", "failed", "skipped"):
                setattr(result, own.status, getattr(result, own.status) + 1)
            before = stock.get(test, Outcome("missing"))
            if own.status != before.status:
                kind = result.excepted if test in exceptions else result.changed
                kind[test] = (before, own)
        results.append(result)
    shared = {
        test: outcome.message
        for test, outcome in stock.items()
        if all(
            run.get(test, Outcome("missing")).status == "failed"
            for run in runs.values()
        )
    }
    return Verdict(results, shared)


def report(verdict: Verdict, exceptions: Mapping[str, str] = EXCEPTIONS) -> str:
    """The table a person reads, then each changed test with its message."""
    lines = [
        f"{'mode':<6} {'passed':>6} {'failed':>6} {'skipped':>7} {'changed':>7} "
        f"{'excepted':>8} {'time':>7}"
    ]
    for r in verdict.results:
        lines.append(
            f"{r.mode:<6} {r.passed:>6} {r.failed:>6} {r.skipped:>7} "
            f"{len(r.changed):>7} {len(r.excepted):>8} {r.seconds:>6.0f}s"
        )
    if verdict.shared_failures:
        lines.append(
            f"\n{len(verdict.shared_failures)} tests fail in stock and every mode "
            "alike (the environment's, not counted as changes); by first line:"
        )
        firsts: dict[str, int] = {}
        for message in verdict.shared_failures.values():
            first = (message.splitlines() or [""])[0][:100]
            firsts[first] = firsts.get(first, 0) + 1
        lines += [f"  {n:>4}  {m}" for m, n in sorted(firsts.items(), key=_count)]
    for r in verdict.results:
        for title, tests in (("changed", r.changed), ("excepted", r.excepted)):
            for test, (before, after) in tests.items():
                lines.append(
                    f"\n{title} in {r.mode}: {test}: {before.status} -> {after.status}"
                )
                if test in exceptions:
                    lines.append(f"  why excepted: {exceptions[test]}")
                message = after.message or before.message
                if message:
                    lines.append("  " + message[:600].replace("\n", "\n  "))
    return "\n".join(lines)


def _count(item: tuple[str, int]) -> tuple[int, str]:
    return -item[1], item[0]


# -- the command line -------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    fetching = commands.add_parser("fetch", help="the sdist, extracted")
    fetching.add_argument("release")
    fetching.add_argument("--cache", type=Path, required=True)
    fetching.add_argument("--dest", type=Path, required=True)
    hf = commands.add_parser("hf-cache", help="the offline HF cache")
    hf.add_argument("home", type=Path)
    comparing = commands.add_parser("compare", help="each mode against stock")
    comparing.add_argument("runs", nargs="+", help="MODE=JUNIT_XML; stock among them")
    args = parser.parse_args(argv)
    if args.command == "fetch":
        extract(fetch(args.release, args.cache), args.dest)
    elif args.command == "hf-cache":
        write_hf_cache(args.home)
    else:
        files = dict(pair.partition("=")[::2] for pair in args.runs)
        verdict = compare({mode: read_junit(Path(p)) for mode, p in files.items()})
        for result in verdict.results:
            result.seconds = junit_seconds(Path(files[result.mode]))
        print(report(verdict))
        print(
            f"\n{verdict.changed} outcomes changed by the plugin (excepted ones aside)"
        )
        return 1 if verdict.changed else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
