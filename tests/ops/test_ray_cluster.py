"""ray_cluster.yaml: Ray's own offline validation (the defaults merge and JSON schema `ray up` applies before
it calls AWS), shell syntax of every command, and the layout the issue asks for."""

from __future__ import annotations

import re
import subprocess
from urllib.parse import urlparse

import pytest
from ray.autoscaler._private.util import prepare_config, validate_config

from engine.checkpoint.layout import parameter_report
from engine.presets import full_config

P5E_HOST_MEMORY = 2048 << 30  # p5e.48xlarge: 2 TiB


@pytest.fixture(scope="module")
def prepared(cluster_yaml) -> dict:
    """What `ray up` works from: the YAML merged with Ray's AWS defaults, setup_commands merged per node type."""
    config = prepare_config(cluster_yaml)
    validate_config(config)
    return config


def _commands(config: dict) -> list[str]:
    keys = ("initialization_commands", "head_setup_commands", "worker_setup_commands",
            "head_start_ray_commands", "worker_start_ray_commands")
    return [c for k in keys for c in config.get(k, [])]


def test_validates_with_rays_schema(prepared):
    assert prepared["provider"]["type"] == "aws"
    assert prepared["head_node_type"] in prepared["available_node_types"]


def test_every_command_is_valid_bash(prepared):
    for cmd in _commands(prepared):
        r = subprocess.run(["bash", "-n", "-c", cmd], capture_output=True, text=True)
        assert r.returncode == 0, f"bash -n failed on:\n{cmd}\n{r.stderr}"


def test_node_types(prepared):
    types = prepared["available_node_types"]
    head = types[prepared["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0 and not head["node_config"]["InstanceType"].startswith("p")
    (worker_name,) = [n for n in types if n != prepared["head_node_type"]]
    worker = types[worker_name]
    assert worker["node_config"]["InstanceType"] == "p5e.48xlarge"  # 8x H200
    assert worker["resources"]["GPU"] == 8
    assert 1 <= worker["min_workers"] <= worker["max_workers"] <= prepared["max_workers"]


def test_project_install_matches_makefile(prepared, cluster_yaml):
    assert cluster_yaml["file_mounts"]["~/dsv41-serve"] == "."
    assert ".gitignore" in cluster_yaml["rsync_filter"]  # no local .venv or checkpoints shipped
    for key in ("head_setup_commands", "worker_setup_commands"):
        assert any(c.startswith("make -C ~/dsv41-serve install") for c in prepared[key]), key


def test_nccl_and_ucx_environment(prepared):
    env_cmd = next(c for c in prepared["worker_setup_commands"] if "dsv41-node.env" in c)
    env = dict(re.findall(r"^export (\w+)=(\S+)$", env_cmd, re.MULTILINE))
    assert (env["NCCL_NVLS_ENABLE"], env["TORCH_SYMM_MEM_DISABLE_MULTICAST"], env["NVSHMEM_DISABLE_NVLS"]) == ("0", "1", "1")
    assert env["RAY_AUTH_MODE"] == "token"
    tls = env["UCX_TLS"].split(",")
    assert "tcp" in tls and {"sm", "self"} <= set(tls)  # never sm,self alone: that hangs at connect
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        start = next(c for c in prepared[key] if "ray start" in c)
        assert start.startswith(". ~/dsv41-node.env") and ". ~/dsv41-secrets.env" in start, key


def test_api_key_comes_from_the_operators_file(prepared, cluster_yaml):
    assert cluster_yaml["file_mounts"]["~/dsv41-secrets.env"] == "~/.dsv41/cluster.env"
    for cmd in _commands(prepared):
        assert "DSV41_API_KEY=" not in cmd, cmd


def test_redis_is_optional_and_matches_the_serve_config(prepared, app_config):
    url = urlparse(app_config["runtime_env"]["env_vars"]["DSV41_REDIS_URL"])
    redis_cmd = next(c for c in prepared["head_setup_commands"] if "redis-server --daemonize" in c)
    assert 'if [ "${DSV41_OPS_START_REDIS:-0}" = 1 ]' in redis_cmd  # off unless the operator enables it
    assert f"--port {url.port}" in redis_cmd
    gcs_port = int(re.search(r"--port=(\d+)", prepared["head_start_ray_commands"][-1]).group(1))
    assert url.port != gcs_port
    # the URL's host name resolves to the head on every node
    assert any(f" {url.hostname}$" in c and "hostname -I" in c for c in prepared["head_setup_commands"])
    assert any(f"$RAY_HEAD_IP {url.hostname}" in c for c in prepared["worker_setup_commands"])


def test_host_memory_leaves_room_for_engram_tables(prepared):
    engram = next(r.num_bytes for r in parameter_report(full_config()) if r.component == "Engram tables")
    start = prepared["worker_start_ray_commands"][-1]
    object_store = int(re.search(r"--object-store-memory=(\d+)", start).group(1))
    assert object_store + 2 * engram < P5E_HOST_MEMORY, (object_store, engram)
