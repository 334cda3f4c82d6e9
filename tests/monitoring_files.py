"""The monitoring files operators load (deploy/monitoring), read for the tests.

The contract test (tests/unit/test_monitoring_contract.py) ties every metric
name, label and status word the alert rules and the dashboard use to what the
package exports; the live check (tests/e2e/test_monitoring.py) evaluates them
in a real Prometheus. Both read the files through this module, so that what one
checks is what the other evaluates.

PromQL is read with a few regular expressions, enough for the expressions
these files hold (selectors, grouping clauses, functions, binary operators);
promtool (``nox -s monitoring``) parses them properly.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MONITORING = REPO / "deploy" / "monitoring"
RULES = MONITORING / "alerts.yml"
RULE_TESTS = MONITORING / "alerts.test.yml"
SCRAPE_CONFIG = MONITORING / "prometheus.example.yml"
DASHBOARD = MONITORING / "dashboard.json"

VLLM_SERIES = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")
"""vLLM's own series the dashboard reads (labels ``model_name``, ``engine``,
like the plugin's). Not the package's to hold: the live check shows a real
server exporting them (tests/e2e/test_monitoring.py)."""
PROMETHEUS_SERIES = ("up",)
PROMETHEUS_LABELS = ("job", "instance")
"""The labels Prometheus adds to every scraped series (its target's)."""

GRAFANA_VARIABLES = ("$model_name", "$engine", "$__rate_interval", "$window")
"""The dashboard variables its queries use, and what the live check puts there."""


@dataclass(frozen=True)
class Query:
    """One PromQL expression of the dashboard or the rules, and where it is."""

    where: str
    expr: str


@dataclass(frozen=True)
class Selector:
    metric: str
    matchers: tuple[tuple[str, str, str], ...]
    """(label, operator, value) of each matcher in braces."""


def load_yaml(path: Path) -> Any:
    import yaml

    return yaml.safe_load(path.read_text())


def alert_rules() -> list[dict[str, Any]]:
    """Every rule of the rule file, in its order."""
    return [rule for group in load_yaml(RULES)["groups"] for rule in group["rules"]]


def dashboard() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text()))


def panel_queries() -> list[Query]:
    """Each query of each dashboard panel (``panel title / refId``)."""
    return [
        Query(f"{panel['title']} / {target['refId']}", target["expr"])
        for panel in dashboard()["panels"]
        for target in panel.get("targets", [])
    ]


def rule_queries() -> list[Query]:
    return [Query(rule["alert"], rule["expr"]) for rule in alert_rules()]


def variable_queries() -> list[Query]:
    """The dashboard variables' ``label_values(metric, label)`` queries."""
    return [
        Query(f"variable {variable['name']}", variable["definition"])
        for variable in dashboard()["templating"]["list"]
        if variable.get("type") == "query"
    ]


def evaluable(expr: str, rate_interval: str = "1m", window: str = "10m") -> str:
    """A dashboard expression as Prometheus takes it: every engine and model,
    Grafana's ``$__rate_interval`` and the dashboard's ``$window`` given."""
    return (
        expr.replace("$model_name", ".*")
        .replace("$engine", ".*")
        .replace("$__rate_interval", rate_interval)
        .replace("$window", window)
    )


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_MATCHER = re.compile(r'([a-zA-Z_]\w*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
_SELECTOR = re.compile(r"([a-zA-Z_:][\w:]*)?\s*\{([^}]*)\}")
_GROUPING = re.compile(
    r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)"
)
_IDENTIFIER = re.compile(r"[a-zA-Z_:][\w:]*")
_KEYWORDS = frozenset(
    [
        "sum",
        "min",
        "max",
        "avg",
        "count",
        "group",
        "stddev",
        "stdvar",
        "topk",
        "bottomk",
        "quantile",
        "count_values",
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "and",
        "or",
        "unless",
        "bool",
        "offset",
    ]
)


def selectors(expr: str) -> list[Selector]:
    """Every series selector: with braces (its matchers) or a bare metric name."""
    found = [
        Selector(metric or "", tuple(_MATCHER.findall(matchers)))
        for metric, matchers in _SELECTOR.findall(expr)
    ]
    bare = _GROUPING.sub(" ", _SELECTOR.sub(" ", _STRING.sub('""', expr)))
    bare = re.sub(r"\[[^\]]*\]", " ", bare)  # range and subquery durations
    for match in _IDENTIFIER.finditer(bare):
        name = match.group()
        following = bare[match.end() :].lstrip()
        if name in _KEYWORDS or following.startswith("("):
            continue  # an aggregation, a keyword or a function
        found.append(Selector(name, ()))
    return found


def grouping_labels(expr: str) -> set[str]:
    """Labels named in ``by``, ``without``, ``on``, ``ignoring``, ``group_*``."""
    return {
        label.strip()
        for listed in _GROUPING.findall(expr)
        for label in listed.split(",")
        if label.strip()
    }


def template_labels(text: str) -> set[str]:
    """Labels an annotation (``{{ $labels.x }}``) or a Grafana legend
    (``{{x}}``) prints."""
    return set(re.findall(r"\$labels\.(\w+)", text)) | set(
        re.findall(r"\{\{\s*([a-zA-Z_]\w*)\s*\}\}", text)
    )


def matched_words(expr: str, label: str) -> set[str]:
    """The values ``label`` is matched against (alternatives of a regex split)."""
    return {
        word
        for selector in selectors(expr)
        for name, _, value in selector.matchers
        if name == label
        for word in value.split("|")
    }
