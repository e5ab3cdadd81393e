"""Where the deployment files are, and small helpers shared by the ops tests."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
DASHBOARD = K8S / "grafana" / "dsv41_dashboard.json"
OPERATIONS_DOC = REPO / "docs" / "operations.md"
# KubeRay's RayService v1 schema, vendored (tests/ops/data/README.md); the shared copy it came from, when present
RAYSERVICE_SCHEMA = Path(__file__).resolve().parent / "data" / "rayservice_v1_openapi.json"
SHARED_CRD = REPO.parent / "shared" / "data" / "kuberay" / "ray.io_rayservices.yaml"


def by_kind(manifests: list[dict], kind: str) -> dict[str, dict]:
    """kind -> {metadata.name: manifest}."""
    return {m["metadata"]["name"]: m for m in manifests if m["kind"] == kind}


# Reserved for the KV-sharing feature (not built yet); the dashboard's panels for them say so.
KV_SHARING_COUNTERS = {"ray_dsv41_kv_pulls_total", "ray_dsv41_kv_pull_fallbacks_total", "ray_dsv41_kv_pull_bytes_total"}
SPECULATIVE_SERIES = {"ray_dsv41_spec_accept_length_bucket"}  # observed only with --speculative-tokens K > 0
SERIES = re.compile(r"\bray_dsv41_[a-z0-9_]+")


def panels(dash: dict) -> list[dict]:
    """The dashboard's panels, rows' nested panels included, rows themselves left out."""
    out = []
    for p in dash["panels"]:
        out.append(p)
        out += p.get("panels", [])
    return [p for p in out if p["type"] != "row"]


def dashboard_series(dash: dict) -> set[str]:
    """The series names the dashboard queries that serve_app exports with its default settings (not the KV-sharing
    or speculative-decoding ones)."""
    queried = {s for p in panels(dash) for t in p["targets"] for s in SERIES.findall(t["expr"])}
    return queried - KV_SHARING_COUNTERS - SPECULATIVE_SERIES
