"""k8s/grafana/dsv41_dashboard.json: valid JSON, a templated Prometheus datasource on every panel and query,
and queries that name only the metrics serve_app/metrics.py defines (with Ray's `ray_` prefix), used the
way their kind allows, plus the KV-sharing names reserved for that feature, only in its own panels."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

import serve_app.metrics
from .ops_files import DASHBOARD, KV_SHARING_COUNTERS, SERIES, panels

_HISTOGRAM_PARTS = ("_bucket", "_count", "_sum")


def defined_metrics() -> dict[str, str]:
    """'ray_' + name -> counter | histogram | gauge, from the calls in serve_app/metrics.py."""
    tree = ast.parse(Path(serve_app.metrics.__file__).read_text())
    out = {}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("counter", "histogram", "gauge") and isinstance(node.args[0], ast.Constant)):
            out["ray_" + node.args[0].value] = node.func.id
    return out


def base_name(series: str, kinds: dict[str, str]) -> str:
    for suffix in _HISTOGRAM_PARTS:
        if series.endswith(suffix) and kinds.get(series.removesuffix(suffix)) == "histogram":
            return series.removesuffix(suffix)
    return series


@pytest.fixture(scope="module")
def dash() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_metrics_module_defines_what_we_expect():
    kinds = defined_metrics()
    assert len(kinds) >= 10 and set(kinds.values()) == {"counter", "histogram", "gauge"}, kinds


def test_datasource_is_templated(dash):
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ref = {"type": "prometheus", "uid": "${datasource}"}
    for p in panels(dash):
        assert p["datasource"] == ref, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"] == ref, p["title"]


def test_panel_ids_unique(dash):
    ids = [p["id"] for p in dash["panels"]] + [q["id"] for p in dash["panels"] for q in p.get("panels", [])]
    assert len(ids) == len(set(ids))


def test_queries_name_only_defined_metrics(dash):
    kinds = defined_metrics()
    for p in panels(dash):
        for t in p["targets"]:
            for series in SERIES.findall(t["expr"]):
                name = base_name(series, kinds)
                if name in KV_SHARING_COUNTERS:
                    assert "KV sharing, when enabled" in p["title"], p["title"]
                    assert "KV-sharing feature" in p["description"], p["title"]
                    continue
                assert name in kinds, f"{p['title']}: {series} is not defined in serve_app/metrics.py"
                if kinds[name] == "histogram":
                    assert series.endswith(_HISTOGRAM_PARTS), f"{p['title']}: {series}"


def test_rates_only_over_counters_and_buckets(dash):
    kinds = defined_metrics()
    for p in panels(dash):
        for t in p["targets"]:
            for series in re.findall(r"rate\((ray_dsv41_[a-z0-9_]+)", t["expr"]):
                name = base_name(series, kinds)
                assert name in KV_SHARING_COUNTERS or kinds[name] in ("counter", "histogram"), f"{p['title']}: {series}"


def test_every_metric_has_a_panel(dash):
    kinds = defined_metrics()
    used = {base_name(s, kinds) for p in panels(dash) for t in p["targets"] for s in SERIES.findall(t["expr"])}
    assert set(kinds) <= used, set(kinds) - used
    assert KV_SHARING_COUNTERS <= used
