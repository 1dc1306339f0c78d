"""deploy/prometheus/ checked by Prometheus's own tools: the scrape config and
the alert rules pass ``promtool check``, every alert's unit tests
(rules_test.yml) pass ``promtool test rules`` and cover it firing and not
firing, and the alerts read only the cluster-wide series of the metrics
contract (tests/_cluster_series.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from _cluster_series import SCRAPE_SERIES, labels_of, series_of
from _prometheus import (
    PROMETHEUS_DIR,
    alert_rules,
    label_names,
    load_yaml,
    metric_names,
    promtool,
    template_labels,
)

CONFIG = PROMETHEUS_DIR / "prometheus.yml"
RULES = PROMETHEUS_DIR / "rules.yml"
RULES_TEST = PROMETHEUS_DIR / "rules_test.yml"

#: The alerts issue 27 asks for (docs/operations.md#alerts explains each by this name).
ALERTS = {
    "LevelWaitPastAgingBound",
    "BackendCircuitOpen",
    "QuotaNearExhaustion",
    "DLQGrowing",
    "TenantPastSoftBudget",
    "ProjectionLagging",
    "NoBinder",
    "ExporterDown",
    # Issue 30 item 4: store use, where `renqueue status` warns.
    "StoreNearLimit",
    # Cancellations acknowledged by RQ_CANCELS that the log has not sourced.
    "CancellationsNotSourced",
    # Binding split in groups: requests sent without their route not forwarded.
    "ForwardingStalled",
}


def test_the_scrape_config_and_the_rules_it_loads_pass_promtool_check_config() -> None:
    result = promtool("check", "config", CONFIG)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 1 rule files found" in result.stdout + result.stderr


def test_the_alert_rules_pass_promtool_check_rules() -> None:
    result = promtool("check", "rules", RULES)
    assert result.returncode == 0, result.stdout + result.stderr
    rules = alert_rules(load_yaml(RULES))
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout + result.stderr


def test_the_alert_rules_pass_their_unit_tests() -> None:
    result = promtool("test", "rules", RULES_TEST)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr


def test_the_unit_tests_fail_when_an_alert_never_fires(tmp_path: Path) -> None:
    """The unit tests see each alert fire: with one alert's expression made
    never true, ``promtool test rules`` fails."""
    rules = load_yaml(RULES)
    (tmp_path / "rules_test.yml").write_text(RULES_TEST.read_text())
    for name in sorted(ALERTS):
        broken: Any = yaml.safe_load(yaml.safe_dump(rules))
        for rule in alert_rules(broken):
            if rule["alert"] == name:
                rule["expr"] = "vector(1) == 0"
        (tmp_path / "rules.yml").write_text(yaml.safe_dump(broken))
        result = promtool("test", "rules", tmp_path / "rules_test.yml")
        assert result.returncode != 0, f"rules_test.yml passes with {name} never firing"
        assert name in result.stdout + result.stderr


def test_every_alert_is_unit_tested_firing_and_not_firing() -> None:
    names = {rule["alert"] for rule in alert_rules(load_yaml(RULES))}
    assert names == ALERTS
    cases = [case for test in load_yaml(RULES_TEST)["tests"] for case in test["alert_rule_test"]]
    for name in sorted(names):
        expected = [case["exp_alerts"] for case in cases if case["alertname"] == name]
        assert any(expected), f"no unit test of {name} firing"
        assert [] in expected, f"no unit test of {name} not firing"


@pytest.mark.parametrize("rule", alert_rules(load_yaml(RULES)), ids=lambda rule: rule["alert"])
def test_every_alert_waits_has_a_severity_and_says_what_to_do(rule: dict[str, Any]) -> None:
    assert rule.get("for"), "an alert with no `for:` fires on one bad scrape"
    assert rule["labels"]["severity"] in {"warning", "critical"}
    notes = rule["annotations"]
    assert notes["summary"].strip()
    assert "docs/operations.md#alerts" in notes["description"]
    assert notes["runbook_url"] == "docs/operations.md#alerts"


@pytest.mark.parametrize("rule", alert_rules(load_yaml(RULES)), ids=lambda rule: rule["alert"])
def test_every_alert_reads_only_series_and_labels_of_the_contract(rule: dict[str, Any]) -> None:
    names = metric_names(rule["expr"])
    assert names, f"no series found in {rule['expr']!r}"
    known = set().union(*(labels_of(name) for name in names))
    for name in names:
        assert series_of(name) or name in SCRAPE_SERIES, f"{name} is not in the metrics contract"
    used = label_names(rule["expr"])
    used |= template_labels(" ".join(rule["annotations"].values()))
    assert used <= known, f"labels {sorted(used - known)} are on none of {sorted(names)}"


def test_the_scrape_config_scrapes_the_exporter_and_loads_these_rules() -> None:
    config = load_yaml(CONFIG)
    assert config["rule_files"] == ["rules.yml"]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    # ExporterDown names the exporter's job.
    assert set(jobs) == {"renqueue-exporter", "renqueue-gateway", "renqueue-processes"}
    assert jobs["renqueue-gateway"]["metrics_path"] == "/metrics"
    for job in jobs.values():
        for group in job["static_configs"]:
            assert all(target.startswith("127.0.0.1:") for target in group["targets"])
