"""deploy/grafana/: the provisioned dashboard is valid Grafana JSON on the
provisioned datasource, every query in it parses as PromQL (promtool) and reads
only series and labels of the metrics contract, and every series of the
contract is on a panel."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from _cluster_series import CLUSTER_SERIES, labels_of, series_of
from _prometheus import GRAFANA_DIR, label_names, legend_labels, load_yaml, metric_names, promtool

DASHBOARD = GRAFANA_DIR / "dashboards" / "renqueue.json"
DATASOURCES = GRAFANA_DIR / "provisioning" / "datasources" / "prometheus.yml"
PROVIDERS = GRAFANA_DIR / "provisioning" / "dashboards" / "renqueue.yml"

#: What Grafana puts in for its own variables when it runs a query.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "1h"}


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def panels() -> list[dict[str, Any]]:
    return [panel for panel in dashboard()["panels"] if panel["type"] != "row"]


def queries() -> list[tuple[str, dict[str, Any]]]:
    """Each panel's title and each of its targets."""
    return [(panel["title"], target) for panel in panels() for target in panel["targets"]]


def promql(expr: str) -> str:
    """A panel's query as Prometheus gets it from Grafana."""
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    return expr


def test_the_dashboard_is_grafana_json_on_the_provisioned_datasource() -> None:
    board = dashboard()
    assert board["uid"]
    assert board["title"]
    assert board["schemaVersion"] >= 36
    [source] = load_yaml(DATASOURCES)["datasources"]
    assert source["type"] == "prometheus"
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids)), "two panels share an id"
    for panel in board["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] >= 0, panel["title"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        assert grid["h"] > 0, panel["title"]
        assert grid["y"] >= 0, panel["title"]
    for panel in panels():
        assert panel["title"], panel["id"]
        assert panel["description"], panel["title"]
        assert panel["targets"], f"panel {panel['title']!r} queries nothing"
        assert panel["datasource"]["uid"] == source["uid"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == source["uid"], panel["title"]
            assert target["expr"].strip(), panel["title"]
            assert target["refId"], panel["title"]


def test_no_two_panels_overlap() -> None:
    cells: dict[tuple[int, int], str] = {}
    for panel in dashboard()["panels"]:
        grid = panel["gridPos"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = panel["title"]


def test_the_provider_loads_the_dashboards_folder() -> None:
    [provider] = load_yaml(PROVIDERS)["providers"]
    assert provider["type"] == "file"
    assert provider["options"]["path"].startswith("/etc/grafana/dashboards")


def test_every_query_parses_as_promql(tmp_path: Path) -> None:
    """Each query as a recording rule: ``promtool check rules`` parses them all."""
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"panel_query_{n}", "expr": promql(target["expr"])}
                    for n, (_title, target) in enumerate(queries())
                ],
            }
        ]
    }
    file = tmp_path / "queries.yml"
    file.write_text(yaml.safe_dump(rules))
    result = promtool("check", "rules", file)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("title", "target"), queries(), ids=[f"{title} {t['refId']}" for title, t in queries()]
)
def test_every_query_reads_only_series_and_labels_of_the_contract(
    title: str, target: dict[str, Any]
) -> None:
    names = metric_names(target["expr"])
    assert names, f"no series in {target['expr']!r}"
    for name in names:
        assert series_of(name), f"{name} is not in the metrics contract"
    known = set().union(*(labels_of(name) for name in names))
    used = label_names(target["expr"]) | legend_labels(target["legendFormat"])
    assert used <= known, f"labels {sorted(used - known)} are on none of {sorted(names)}"


def test_every_series_of_the_contract_is_on_a_panel() -> None:
    shown = {series_of(name) for _title, t in queries() for name in metric_names(t["expr"])}
    assert set(CLUSTER_SERIES) - shown == set()
