"""The alert rules and the dashboard (deploy/monitoring) speak the package's names.

Every metric name, label and status word they use is one the package exports
(``vllm_mamba_align.metrics``, ``vllm_mamba_align.audit.export``), or
Prometheus's own (``up``, ``job``, ``instance``), or one of vLLM's series the
live check shows a real server exporting (tests/e2e/test_monitoring.py). A
rename in the package fails here, not as an alert that never fires. ``nox -s
monitoring`` runs promtool on the same files; docs/audit.md shows them, held
equal below.
"""

from __future__ import annotations

import json
import re

import monitoring_files as files
import pytest

from vllm_mamba_align import audit, metrics
from vllm_mamba_align.audit import export

pytest.importorskip("yaml")

COUNTERS = {metrics.PREFIX + name + "_total" for name, _ in export.COUNTERS.values()}
LABELS_OF = {
    **{name: set(metrics.LABELS) for name in COUNTERS},
    metrics.INFO: set(metrics.INFO_LABELS),
    **{name: set(metrics.LABELS) for name in files.VLLM_SERIES},
    **{name: set() for name in files.PROMETHEUS_SERIES},
}
"""Each series the files may read -> the labels it carries besides Prometheus's."""
DOCS = files.REPO / "docs" / "audit.md"


def queries() -> list[files.Query]:
    return [*files.rule_queries(), *files.panel_queries()]


def test_the_files_use_expressions_at_all() -> None:
    """The readers below find what they check (a reader that finds nothing
    would pass every check)."""
    assert {rule["alert"] for rule in files.alert_rules()} >= {
        "MambaStatesPoisoned",
        "MambaAlignFixNotActive",
    }
    names = {s.metric for q in queries() for s in files.selectors(q.expr)}
    assert metrics.INFO in names and files.VLLM_SERIES[0] in names
    assert len(files.panel_queries()) >= 5


@pytest.mark.parametrize("query", queries(), ids=lambda q: q.where)
def test_every_series_and_label_is_one_the_package_or_prometheus_exports(
    query: files.Query,
) -> None:
    found = files.selectors(query.expr)
    assert found, f"{query.where}: no series in {query.expr!r}"
    known = set(files.PROMETHEUS_LABELS)
    for selector in found:
        assert selector.metric in LABELS_OF, (
            f"{query.where}: {selector.metric!r} is not a series vllm_mamba_align."
            f"metrics exports (or vLLM's {files.VLLM_SERIES}, or Prometheus's "
            f"{files.PROMETHEUS_SERIES})"
        )
        carried = LABELS_OF[selector.metric] | set(files.PROMETHEUS_LABELS)
        for label, _, _ in selector.matchers:
            assert label in carried, f"{query.where}: {selector.metric} has no {label}"
        known |= carried
    for label in files.grouping_labels(query.expr):
        assert label in known, f"{query.where}: no series here carries {label!r}"


@pytest.mark.parametrize("query", files.variable_queries(), ids=lambda q: q.where)
def test_the_dashboard_variables_read_labels_the_info_series_carries(
    query: files.Query,
) -> None:
    variable = re.fullmatch(r"label_values\((\S+), (\w+)\)", query.expr)
    assert variable is not None, query.expr
    assert variable.group(2) in LABELS_OF[variable.group(1)], query.expr


@pytest.mark.parametrize("query", queries(), ids=lambda q: q.where)
def test_every_status_word_is_one_the_info_series_carries(query: files.Query) -> None:
    for word in files.matched_words(query.expr, "status"):
        assert word in metrics.STATUSES, (
            f"{query.where}: status {word!r} is not one of {metrics.STATUSES}"
        )


def test_fix_not_active_matches_every_status_but_the_fix_and_nothing_to_fix() -> None:
    """Every status word the package has is either the fix (ACTIVE), nothing
    to fix (inactive), or one MambaAlignFixNotActive matches: a new word
    cannot slip past the rule."""
    (rule,) = [r for r in files.alert_rules() if r["alert"] == "MambaAlignFixNotActive"]
    matched = files.matched_words(rule["expr"], "status")
    assert matched | {"ACTIVE", "inactive"} == set(metrics.STATUSES)
    assert not matched & {"ACTIVE", "inactive"}
    assert "fires in both by design" in rule["annotations"]["description"]


def test_annotations_and_legends_print_labels_their_series_carry() -> None:
    for rule in files.alert_rules():
        carried = set(files.PROMETHEUS_LABELS)
        for selector in files.selectors(rule["expr"]):
            carried |= LABELS_OF[selector.metric]
        if re.search(r"\b(sum|max|min|avg|count) by", rule["expr"]):
            carried &= files.grouping_labels(rule["expr"])
        for text in rule["annotations"].values():
            printed = files.template_labels(text)
            assert printed <= carried, f"{rule['alert']}: {printed - carried}"
    for panel in files.dashboard()["panels"]:
        for target in panel["targets"]:
            printed = files.template_labels(target.get("legendFormat", ""))
            assert printed <= files.grouping_labels(target["expr"]), panel["title"]


def test_the_poisoning_advice_is_the_audits_own() -> None:
    """The alerts say what the audit's WARNING line says, word for word."""
    for name in ("MambaStatesPoisoned", "MambaAlignFixNotActive"):
        (rule,) = [r for r in files.alert_rules() if r["alert"] == name]
        assert rule["annotations"]["description"].endswith(audit.SWITCH_THE_FIX_ON)


def test_the_rule_tests_feed_series_shaped_as_the_package_exports() -> None:
    """promtool's synthetic series carry exactly the labels of the real ones,
    with status words the package has: the tests exercise what a server shows."""
    shape = re.compile(r"([\w:]+)\{(.*)\}")
    for test in files.load_yaml(files.RULE_TESTS)["tests"]:
        for series in test["input_series"]:
            match = shape.fullmatch(series["series"])
            assert match is not None, series
            name = match.group(1)
            labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2)))
            if name in files.PROMETHEUS_SERIES:
                assert set(labels) == set(files.PROMETHEUS_LABELS), series
                continue
            assert set(labels) == LABELS_OF[name] | set(files.PROMETHEUS_LABELS), series
            if name == metrics.INFO:
                assert labels["status"] in metrics.STATUSES, series


def test_the_dashboard_states_its_schema_version_and_variables() -> None:
    board = files.dashboard()
    assert isinstance(board["schemaVersion"], int)
    used = {
        variable
        for query in files.panel_queries()
        for variable in re.findall(r"\$\w+", query.expr)
    }
    assert used <= set(files.GRAFANA_VARIABLES), used
    defined = {"$" + v["name"] for v in board["templating"]["list"]}
    assert used - {"$__rate_interval"} <= defined


def test_the_docs_show_the_files_not_a_copy() -> None:
    """docs/audit.md includes the rule file (mkdocs snippets), and each PromQL
    example it prints is a dashboard query, character for character."""
    text = DOCS.read_text()
    assert '--8<-- "deploy/monitoring/alerts.yml"' in text
    assert "\ngroups:" not in text  # no hand copy of a rule file
    for path in (files.RULES, files.SCRAPE_CONFIG, files.DASHBOARD, files.RULE_TESTS):
        assert str(path.relative_to(files.REPO)) in text, path.name
    examples = re.findall(r"```promql\n(.*?)```", text, re.DOTALL)
    assert examples
    dashboard = {query.expr.strip() for query in files.panel_queries()}
    for example in examples:
        assert example.strip() in dashboard, example


def test_the_docs_list_the_status_words_the_package_has() -> None:
    (row,) = [
        line
        for line in DOCS.read_text().splitlines()
        if line.startswith(f"| `{metrics.INFO}` |")
    ]
    listed = re.search(r"`status` \(([^)]*)\)", row)
    assert listed is not None, row
    assert re.findall(r"`(\w+)`", listed.group(1)) == list(metrics.STATUSES)


def test_the_picture_names_the_commit_its_data_came_from() -> None:
    recorded = json.loads(
        (files.REPO / "docs" / "img" / "audit-counter.json").read_text()
    )
    commit = re.match(r"commit (\w+):", recorded["note"])
    assert commit is not None, recorded["note"]
    assert f"Drawn at commit {commit.group(1)} " in DOCS.read_text()
