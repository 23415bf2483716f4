"""Every file in config/monitoring/ parses, passes promtool, and names metrics that exist."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from test_metrics import inprocess_exposition, samples_by_name

MONITORING = Path(__file__).resolve().parents[1] / "config" / "monitoring"
DASHBOARD = MONITORING / "grafana" / "dashboards" / "zerotuner.json"
RULES = MONITORING / "rules" / "zerotuner.yml"
METRIC = re.compile(r"\bzerotuner_[a-z0-9_]+")
# Grafana variables, replaced by values Prometheus accepts so promtool can parse the queries.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$instance": ".*"}


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool not installed (Debian package prometheus)")
    return subprocess.run([path, *args], capture_output=True, text=True, timeout=60, cwd=cwd)


def dashboard_panels() -> list[dict]:
    panels = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))  # collapsed rows hold their panels
    return panels


def dashboard_queries() -> list[str]:
    return [t["expr"] for p in dashboard_panels() for t in p.get("targets", []) if t.get("expr")]


def rule_queries() -> list[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule["expr"] for group in groups for rule in group["rules"]]


@pytest.fixture(scope="module")
def exposed_names(tmp_path_factory) -> set[str]:
    text = inprocess_exposition(tmp_path_factory.mktemp("exposition"), cuda=True)
    return set(samples_by_name(text))


def test_prometheus_scrapes_the_zerotuner_endpoint():
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert jobs["zerotuner"]["static_configs"][0]["targets"] == ["zerotuner:9464"]
    result = promtool("check", "config", str(MONITORING / "prometheus.yml"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 rule files found" in result.stdout  # the rules glob resolves next to the config


def test_grafana_provisioning_points_at_the_mounted_dashboards():
    provider = yaml.safe_load(
        (MONITORING / "grafana/provisioning/dashboards/zerotuner.yaml").read_text()
    )["providers"][0]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"  # compose.yaml's mount
    source = yaml.safe_load(
        (MONITORING / "grafana/provisioning/datasources/prometheus.yaml").read_text()
    )["datasources"][0]
    assert source["type"] == "prometheus"
    variables = {v["name"]: v for v in json.loads(DASHBOARD.read_text())["templating"]["list"]}
    assert variables["datasource"]["current"]["value"] == source["uid"]


def test_dashboard_has_the_panels_operators_need():
    titles = {p["title"] for p in dashboard_panels()}
    for needed in (
        "Step time p50 / p95",
        "Device memory per rank vs total",
        "Loss",
        "Learning rate",
        "Throughput",
        "Checkpoint age",
        "Phase",
    ):
        assert needed in titles
    step_time = next(p for p in dashboard_panels() if p["title"] == "Step time p50 / p95")
    exprs = " ".join(t["expr"] for t in step_time["targets"])
    assert "histogram_quantile(0.5," in exprs and "histogram_quantile(0.95," in exprs
    assert "rate(zerotuner_step_duration_seconds_bucket" in exprs


def test_dashboard_layout_is_sane():
    panels = dashboard_panels()
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    boxes = [(p["title"], p["gridPos"]) for p in panels]
    for i, (title_a, a) in enumerate(boxes):
        assert a["x"] + a["w"] <= 24, title_a
        for title_b, b in boxes[i + 1 :]:
            overlap = (
                a["x"] < b["x"] + b["w"]
                and b["x"] < a["x"] + a["w"]
                and a["y"] < b["y"] + b["h"]
                and b["y"] < a["y"] + a["h"]
            )
            assert not overlap, f"{title_a} overlaps {title_b}"


@pytest.mark.parametrize("source", ["dashboard", "rules"])
def test_every_queried_metric_exists(source, exposed_names):
    queries = dashboard_queries() if source == "dashboard" else rule_queries()
    assert queries
    named = {name for query in queries for name in METRIC.findall(query)}
    assert named - exposed_names == set()


def test_every_dashboard_query_is_valid_promql(tmp_path):
    rules = []
    for i, query in enumerate(dashboard_queries()):
        for variable, replacement in GRAFANA_VARIABLES.items():
            query = query.replace(variable, replacement)
        assert "$" not in query, f"unhandled Grafana variable in {query}"
        rules.append({"record": f"zerotuner:dashboard_query_{i}", "expr": query})
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def test_alert_rules_fire_when_they_should(tmp_path):
    tests = {
        "rule_files": [str(RULES)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    {"series": 'zerotuner_healthy{instance="a"}', "values": "1 1 0 0 0 0"},
                    {
                        "series": 'zerotuner_loss{instance="a",rank="0"}',
                        "values": "0.5 NaN NaN NaN",
                    },
                    {
                        "series": 'zerotuner_loss{instance="a",rank="1"}',
                        "values": "0.5 0.4 0.3 0.2",
                    },
                ],
                "alert_rule_test": [
                    {"eval_time": "2m", "alertname": "ZerotunerHung", "exp_alerts": []},
                    {
                        "eval_time": "4m",
                        "alertname": "ZerotunerHung",
                        "exp_alerts": [
                            {
                                "exp_labels": {"severity": "critical", "instance": "a"},
                                "exp_annotations": {
                                    "summary": "zerotuner on a finished no step for "
                                    "ZT_HANG_TIMEOUT_SECONDS",
                                    "description": "/healthz answers 503; a Kubernetes "
                                    "liveness probe restarts the pod.",
                                },
                            }
                        ],
                    },
                    {
                        "eval_time": "3m",
                        "alertname": "ZerotunerLossNotFinite",
                        "exp_alerts": [
                            {
                                "exp_labels": {"severity": "warning", "instance": "a", "rank": "0"},
                                "exp_annotations": {
                                    "summary": "loss of rank 0 on a is NaN or infinite"
                                },
                            }
                        ],
                    },
                ],
            }
        ],
    }
    path = tmp_path / "tests.yml"
    path.write_text(yaml.safe_dump(tests, sort_keys=False))
    result = promtool("test", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert promtool("check", "rules", str(RULES)).returncode == 0
