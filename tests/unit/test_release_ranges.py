"""Version ranges written in the package and its docs agree with the release table.

A range (``X.Y.Z+`` or ``X.Y.Z-A.B.C``, hyphen or en dash, spaced or not)
written next to a fact the tables hold (a :class:`releases.SplitBody` field, a
row of ``releases.RELEASE_FACTS``, the worker seed's sites, a checkpoint
backend's first release) must start and end where that fact changes in the
table's rows: a range that starts a release late (``0.27.1+`` where the row of
0.27.0 already has the field) is a copy that drifted. Messages derive their
ranges from the table (:func:`releases.describe_releases`); this test holds
every written copy to it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.version import Version

from vllm_mamba_align import refusals, releases
from vllm_mamba_align.releases import (
    BODIES,
    SEED_BODIES,
    SUPPORTED_RELEASES,
    SeedSite,
    SplitBody,
    describe_releases,
    releases_where,
)

ROOT = Path(__file__).resolve().parents[2]
RANGE = re.compile(
    r"(?<![\w.])(0\.\d+\.\d+)(?: ?(\+)| ?[-\u2013] ?(0\.\d+\.\d+))(?![\w.])"
)
GENERATED = re.compile(r"<!-- (\w+):begin.*?<!-- \1:end -->", re.DOTALL)
PARAGRAPH = re.compile(r"\n\s*\n|\n\s*[-*|] ")
"""Where a paragraph, a list item or a table row ends."""
WINDOW = 100
"""Characters on either side of a range in which a fact's words make it that
fact's range (whitespace collapsed, so a wrapped docstring reads as one line)."""


@dataclass(frozen=True)
class Fact:
    """One fact of the release table and the words that name it in prose."""

    name: str
    words: str
    """A regular expression (case-sensitive) for the words that name it."""
    value: Callable[[str], object]
    """The fact's value on a supported release."""


def _body_of(release: str) -> SplitBody:
    (body,) = [body for body in BODIES if release in body.releases]
    return body


def _seed_site(release: str) -> object:
    for code in SEED_BODIES:
        first, _, last = code.releases.partition("-")
        if Version(first) <= Version(release) <= Version(last or first):
            return code.site
    return SeedSite.ABSENT


def _field(name: str) -> Callable[[str], object]:
    return lambda release: getattr(_body_of(release), name)


FACTS = (
    Fact(
        "wide_block_exemption",
        r"wide_block_exemption|too wide|wide block|sub-block|\bstall",
        _field("wide_block_exemption"),
    ),
    Fact(
        "aligns_drafter_tail",
        r"aligns_drafter_tail|drafter tail|floor_guard_bounds",
        _field("aligns_drafter_tail"),
    ),
    Fact(
        "stops_after_mid_block_start",
        r"stops_after_mid_block_start|mid-block|next_block_boundary",
        _field("stops_after_mid_block_start"),
    ),
    Fact(
        "extra_parameter",
        r"extra_parameter|num_uncached_common_prefix_tokens|fifth parameter",
        _field("extra_parameter"),
    ),
    Fact(
        "prefill",
        r"NO_OUTPUT_YET|BEFORE_PREFILL_END|num_output_tokens",
        _field("prefill"),
    ),
    Fact(
        "internal_checkpoint",
        r"internal_checkpoint|ALIGNED_START|OBSERVED|is_mamba_prefill_checkpoint_valid"
        r"|checkpoints? (that |the )?chunks? internally|internal checkpointing",
        _field("internal_checkpoint"),
    ),
    Fact(
        "checkpoint_grid",
        r"checkpoint_grid|PREFIX_MATCH_UNIT|CACHE_HIT_ALIGNMENT",
        _field("checkpoint_grid"),
    ),
    Fact(
        "checkpoint_write_stride",
        r"checkpoint_write_stride|16-aligned|FLASHKDA_CHUNK_SIZE",
        _field("checkpoint_write_stride"),
    ),
    Fact(
        "checkpoint_blocks_unalign",
        r"checkpoint_blocks_unalign|unaligned anywhere",
        _field("checkpoint_blocks_unalign"),
    ),
    Fact(
        "drops_mid_block_stop",
        r"drops_mid_block_stop|drop that stop",
        _field("drops_mid_block_stop"),
    ),
    Fact("split body", r"\bbody\b|\bbodies\b", lambda release: _body_of(release)),
    Fact(
        "worker seed",
        r"worker seed|worker's seed|\bre-seed|seeds with|seed site|V2's seed",
        _seed_site,
    ),
)
"""The split bodies' facts and the worker seed's."""

RELEASE_FACT_WORDS: dict[str, str] = {
    "SELECTOR_ASKS_BATCH_INVARIANCE": r"batch.invarian|VLLM_BATCH_INVARIANT"
    r"|Mamba backend selector|no such check",
    "SELECTOR_TAKES_BACKEND_ENUM": r"MAMBA_TYPE_TO_BACKEND_MAP|backend enum"
    r"|attention.backend names",
    "REQUEST_NEEDS_EOS_TOKEN_ID": r"eos_token_id",
    "HASH_BLOCK_CHOSEN": r"supports_hash_block|hash block (can|may) be chosen",
    "RETENTION_IN_KV_CONFIG": r"retention_in_kv_config|KV-cache config carries"
    r"|prefix.cache.retention.interval|retention variable|variable's default"
    r"|RETENTION_VARIABLE|VLLM_PREFIX_CACHE_RETENTION_INTERVAL",
    "LOOKAHEAD_HASHES": r"lookahead (block )?hashes|supports_lookahead_hashes",
    "HIDDEN_STATE_SCALING": r"HIDDEN_STATE_SCALING|multiplies every group",
    "RETENTION_FOR_MAMBA": r"reach(es)? Mamba states|masks by|masks_by_retention"
    r"|RETENTION_VARIABLE|VLLM_PREFIX_CACHE_RETENTION_INTERVAL",
    "HIT_ALIGNMENT": r"(?<!cache-)hit alignment",
    "EAGLE_REPLAY_PAIR": r"replay positions|replay.boundary function"
    r"|get_replay_boundaries",
    "REPLAY_BOUNDARIES_FUNCTION": r"\b(get_)?replay_boundaries\b",
    "EAGLE_JUNCTION_BLOCK": r"drop_eagle_group_ids|eagle_group_ids"
    r"|below (an|the) EAGLE junction|eagle_junction",
    "MANAGER_LEAVES_SCRATCH": r"skips_scratch_move|leaves? (them|the scratch)"
    r"|where they stood|MANAGER_LEAVES_SCRATCH",
    "MANAGER_REKEYS_CHECKPOINT": r"rekeys?_checkpoint|re-keys?",
    "CACHE_BLOCK_DIVIDES": r"C must divide B|CACHE_BLOCK_DIVIDES|DIVISOR",
    "CACHE_BLOCK_EQUALS": r"refuses? C < B|C == B at startup|CACHE_BLOCK_EQUALS",
    "MODEL_RUNNER_V1": r"Model Runner V1|VLLM_USE_V2_MODEL_RUNNER",
    "WORKER_CHECKS_GROUPS_AT_START": r"WORKER_CHECKS_GROUPS_AT_START"
    r"|worker (asserts|checks|stops)|initiali[sz]es? (its|the) KV cache"
    r"|check the groups|worker's first step"
    r"|initialize_kv_cache|Model Runner V2 (stops|asserts)",
}
"""The words that name each row of ``releases.RELEASE_FACTS`` in prose, by the
row's name in releases.py."""


def _release_fact(name: str) -> Fact:
    fact = getattr(releases, name)
    assert isinstance(fact, releases.ReleaseFact), name
    return Fact(name, RELEASE_FACT_WORDS[name], fact.holds)


FACTS += tuple(_release_fact(name) for name in RELEASE_FACT_WORDS)


def _backend_fact(backend: str, since: str) -> Fact:
    return Fact(
        f"checkpoint backend {backend}",
        rf"`{re.escape(backend)}`|\b{re.escape(backend)} (GPU )?backend",
        lambda release: Version(release) >= Version(since),
    )


FACTS += tuple(
    _backend_fact(backend, since)
    for backend, since in releases.CHECKPOINT_BACKENDS_SINCE.items()
)


def test_the_release_notes_list_every_release_fact_as_its_row_has_it() -> None:
    """docs/releases.md's table of release facts: each row's releases as
    ``str(fact)`` writes them, from the row."""
    notes = (ROOT / "docs" / "releases.md").read_text()
    listed = {
        name: line.rsplit("|", 2)[-2].strip()
        for line in notes.splitlines()
        for name in RELEASE_FACT_WORDS
        if line.startswith(f"| `{name}` |")
    }
    expected = {name: str(getattr(releases, name)) for name in RELEASE_FACT_WORDS}
    assert listed == expected


def test_every_release_fact_has_its_words() -> None:
    """A row added to the table gets words here, so its prose is checked too."""
    named = {id(getattr(releases, name)) for name in RELEASE_FACT_WORDS}
    assert named == {id(fact) for fact in releases.RELEASE_FACTS}


def _changes(fact: Fact) -> tuple[set[str], set[str]]:
    """Where the fact's runs start and where they end, over the supported
    releases in order."""
    values = [fact.value(release) for release in SUPPORTED_RELEASES]
    starts = {
        release
        for index, release in enumerate(SUPPORTED_RELEASES)
        if index == 0 or values[index] != values[index - 1]
    }
    ends = {
        release
        for index, release in enumerate(SUPPORTED_RELEASES)
        if index == len(values) - 1 or values[index] != values[index + 1]
    }
    return starts, ends


def _agrees(fact: Fact, first: str, last: str | None) -> bool:
    """Whether ``first``-``last`` starts and ends where the fact changes; a
    ``first+`` range (``last`` None) where it changes and never changes back."""
    starts, ends = _changes(fact)
    if first not in starts:
        return False
    if last is not None:
        return last in ends
    begin = SUPPORTED_RELEASES.index(first)
    if begin == 0:
        return True
    before = fact.value(SUPPORTED_RELEASES[begin - 1])
    return all(fact.value(r) != before for r in SUPPORTED_RELEASES[begin:])


def _agrees_with_any(near: list[Fact], first: str, last: str | None) -> bool:
    """Whether the range agrees with a fact named near it; a closed range may
    also run from where one such fact changes to where another does ("with
    Model Runner V1 on 0.32.0-0.33.0": from the release whose worker checks
    the groups to the last with Model Runner V1)."""
    if any(_agrees(fact, first, last) for fact in near):
        return True
    if last is None:
        return False
    changes = [_changes(fact) for fact in near]
    return any(first in starts for starts, _ in changes) and any(
        last in ends for _, ends in changes
    )


def _texts() -> Iterator[tuple[str, str]]:
    """The package's code and the project's docs, one paragraph or list item
    at a time, whitespace collapsed."""
    paths = [
        *sorted((ROOT / "vllm_mamba_align").rglob("*.py")),
        *sorted((ROOT / "docs").rglob("*.md")),
        ROOT / "README.md",
    ]
    for path in paths:
        # Blocks generated from the matrix records say what each run recorded.
        text = GENERATED.sub("", path.read_text())
        if path.name == "releases.py":
            # The table's own rows are the source, not a copy.
            text = re.sub(r'SeedCode\("[^"]*"|"[0-9a-f]{16}": "[^"]*"', "", text)
        # A range speaks of the words of its own paragraph, list item or row.
        for block in PARAGRAPH.split(text):
            yield str(path.relative_to(ROOT)), " ".join(block.split())


def drifts(texts: Iterator[tuple[str, str]]) -> list[str]:
    """Each range next to a fact's words that disagrees with every such fact."""
    found = []
    for name, text in texts:
        for match in RANGE.finditer(text):
            first, _plus, last = match.groups()
            if first not in SUPPORTED_RELEASES or (
                last is not None and last not in SUPPORTED_RELEASES
            ):
                continue  # not a range of releases the table covers
            around = text[max(0, match.start() - WINDOW) : match.end() + WINDOW]
            near = [fact for fact in FACTS if re.search(fact.words, around)]
            if near and not _agrees_with_any(near, first, last):
                found.append(
                    f"{name}: {match.group(0)!r} near "
                    f"{', '.join(fact.name for fact in near)}: "
                    f"...{text[max(0, match.start() - 60) : match.end() + 20]}..."
                )
    return found


def test_every_written_range_agrees_with_the_release_table() -> None:
    assert drifts(_texts()) == []


def test_a_new_drift_is_caught() -> None:
    """The judge can fail: a copy that starts a release late, or ends one early."""
    late = "which lets a wide block advance in sub-block steps (0.27.1+)"
    early = "the fifth parameter (0.24.0-0.25.0 only)"
    assert len(drifts(iter([("late", late), ("early", early)]))) == 2
    row = "Request() requires an eos_token_id argument (0.15.1-0.17.0)"
    enum = "the selector takes the backend enum (0.28.0+)"
    assert len(drifts(iter([("row", row), ("enum", enum)]))) == 2
    assert drifts(iter([("derived", late.replace("0.27.1", "0.27.0"))])) == []


def test_the_stall_refusal_names_the_first_release_the_table_exempts() -> None:
    exempt = releases_where(lambda body: body.wide_block_exemption)
    assert describe_releases(exempt) == f"{exempt[0]}+"
    (stalling,) = [body for body in BODIES if body.releases == ("0.26.0",)]
    message = str(refusals.refuse_stall(stalling, 2048, 1024, "--budget"))
    assert f"upgrade to vLLM {exempt[0]}+ " in message


@pytest.mark.parametrize(
    ("chosen", "described"),
    [
        (("0.15.0", "0.15.1", "0.16.0"), "0.15.0-0.16.0"),
        (("0.33.0", "0.34.0"), "0.33.0+"),
        (("0.34.0",), "0.34.0"),
        (("0.23.0", "0.25.0", "0.25.1"), "0.23.0, 0.25.0-0.25.1"),
    ],
)
def test_releases_are_described_as_runs(
    chosen: tuple[str, ...], described: str
) -> None:
    assert releases.describe_releases(chosen) == described
