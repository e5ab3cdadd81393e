"""serve_config.yaml offline: Serve's own schema, ServeSettings accepts its args, the deployment overrides name
real deployments and agree with the values serve_app derives from the same args."""

from __future__ import annotations

import importlib
from urllib.parse import urlparse

import pytest
from ray.serve.schema import ServeDeploySchema

from serve_app.app import APP_NAME, build_app
from serve_app.engine_replica import SHARD_PING_TIMEOUT_S
from serve_app.settings import ServeSettings


@pytest.fixture(scope="module")
def settings(app_config) -> ServeSettings:
    return ServeSettings.from_mapping(app_config["args"], environ={})


@pytest.fixture(scope="module")
def code_deployments(settings) -> dict:
    """name -> the serve.Deployment that build_app makes from these settings (nothing is started)."""
    ingress = build_app(settings)._bound_deployment
    engine = ingress.init_args[0]._bound_deployment
    return {d.name: d for d in (ingress, engine)}


def test_validates_with_serve_schema(serve_config):
    parsed = ServeDeploySchema.model_validate(serve_config)
    assert [a.name for a in parsed.applications] == [APP_NAME]


def test_import_path_resolves(app_config):
    module, attr = app_config["import_path"].split(":")
    assert callable(getattr(importlib.import_module(module), attr))


def test_args_are_valid_settings(app_config, settings):
    assert settings.device == "cuda" and settings.num_shards == 1
    # the key comes from DSV41_API_KEY in the nodes' environment; Serve's proxy owns host and port
    assert not {"api_key", "host", "port"} & set(app_config["args"])
    assert settings.api_key is None


def test_runtime_env_sets_variables_only(app_config):
    runtime_env = app_config["runtime_env"]
    assert set(runtime_env) == {"env_vars"}  # no pip / working_dir: the nodes have the project installed
    env = runtime_env["env_vars"]
    assert "DSV41_API_KEY" not in env
    url = urlparse(env["DSV41_REDIS_URL"])
    assert url.scheme == "redis" and url.hostname and url.port


def test_overrides_name_the_apps_deployments(app_config, code_deployments):
    assert {d["name"] for d in app_config["deployments"]} == set(code_deployments)


def test_overrides_agree_with_args(app_config, settings, code_deployments):
    over = {d["name"]: d for d in app_config["deployments"]}
    engine, ingress = over["EngineReplica"], over["OpenAIIngress"]
    assert engine["num_replicas"] == settings.num_replicas  # the ingress sizes its in-flight cap from args
    assert engine["max_ongoing_requests"] == settings.max_ongoing_requests
    assert engine["health_check_period_s"] == settings.health_check_period_s
    assert engine["graceful_shutdown_timeout_s"] == settings.graceful_shutdown_timeout_s
    assert engine["health_check_timeout_s"] > SHARD_PING_TIMEOUT_S  # the health hook pings the shard this long
    assert ingress["max_ongoing_requests"] == code_deployments["OpenAIIngress"].max_ongoing_requests
    assert ingress["graceful_shutdown_timeout_s"] >= engine["graceful_shutdown_timeout_s"]
    scaling = ingress["autoscaling_config"]
    assert 1 <= scaling["min_replicas"] <= scaling["max_replicas"]


def test_http_port_is_the_servers_default(serve_config):
    assert serve_config["http_options"]["port"] == ServeSettings(checkpoint="x").port == 8000
