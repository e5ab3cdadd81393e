"""The deployment files under test, loaded once: ray_cluster.yaml, serve_config.yaml and the k8s/ manifests.
Everything here is offline (no cloud, no Kubernetes API)."""

from __future__ import annotations

import pytest
import yaml

from .ops_files import K8S, REPO


@pytest.fixture(scope="session")
def serve_config() -> dict:
    return yaml.safe_load((REPO / "serve_config.yaml").read_text())


@pytest.fixture(scope="session")
def app_config(serve_config) -> dict:
    """The one application of serve_config.yaml."""
    (app,) = serve_config["applications"]
    return app


@pytest.fixture(scope="session")
def cluster_yaml() -> dict:
    return yaml.safe_load((REPO / "ray_cluster.yaml").read_text())


@pytest.fixture(scope="session")
def manifests() -> list[dict]:
    """Every document of every k8s/*.yaml, each with its file name under `_file`."""
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                docs.append({**doc, "_file": path.name})
    return docs
