"""k8s/ offline: the RayService against KubeRay's v1 CRD schema (jsonschema, plus the unknown-field check
`kubectl --validate=strict` would make), its embedded Serve config, and the cross-references between
manifests (Secret keys, volume claims, Service selectors, NetworkPolicy selectors, probe ports)."""

from __future__ import annotations

import copy
import json
import re
from urllib.parse import urlparse

import jsonschema
import pytest
import ray
import yaml
from ray.serve.schema import ServeDeploySchema

from engine.checkpoint.layout import parameter_report
from engine.presets import full_config
from serve_app.ingress import OPEN_ROUTES
from .ops_files import RAYSERVICE_SCHEMA, SHARED_CRD, by_kind

KNOWN_KINDS = {("ray.io/v1", "RayService"), ("v1", "Secret"), ("v1", "Service"), ("v1", "PersistentVolumeClaim"),
               ("apps/v1", "Deployment"), ("networking.k8s.io/v1", "NetworkPolicy")}
_QUANTITY = re.compile(r"(\d+)(Ki|Mi|Gi|Ti)?")


def quantity_bytes(q: str) -> int:
    m = _QUANTITY.fullmatch(str(q))
    assert m, f"unsupported quantity {q!r}"
    return int(m.group(1)) << {None: 0, "Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40}[m.group(2)]


def unknown_fields(obj: object, schema: dict, path: str = "") -> list[str]:
    """Paths of keys the schema does not declare (the API server would drop them silently)."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    out: list[str] = []
    if isinstance(obj, dict):
        props, extra = schema.get("properties"), schema.get("additionalProperties")
        for key, value in obj.items():
            if props is not None and key in props:
                out += unknown_fields(value, props[key], f"{path}.{key}")
            elif isinstance(extra, dict):
                out += unknown_fields(value, extra, f"{path}.{key}")
            elif props is not None:
                out.append(f"{path}.{key}")
    elif isinstance(obj, list) and "items" in schema:
        for i, item in enumerate(obj):
            out += unknown_fields(item, schema["items"], f"{path}[{i}]")
    return out


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.fixture(scope="module")
def schema() -> dict:
    return json.loads(RAYSERVICE_SCHEMA.read_text())


@pytest.fixture(scope="module")
def rayservice(manifests) -> dict:
    (rs,) = by_kind(manifests, "RayService").values()
    return {k: v for k, v in rs.items() if k != "_file"}


@pytest.fixture(scope="module")
def ray_pods(rayservice) -> dict[str, dict]:
    """'head' and each worker group's name -> its pod template."""
    cluster = rayservice["spec"]["rayClusterConfig"]
    pods = {"head": cluster["headGroupSpec"]["template"]}
    pods.update({g["groupName"]: g["template"] for g in cluster["workerGroupSpecs"]})
    return pods


@pytest.fixture(scope="module")
def gpu_group(rayservice) -> dict:
    (group,) = rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    return group


def _walk(obj: object):
    if isinstance(obj, dict):
        yield obj
        for v in obj.values():
            yield from _walk(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _walk(v)


def test_every_manifest_is_a_known_kind_with_a_name(manifests):
    assert manifests
    for m in manifests:
        assert (m["apiVersion"], m["kind"]) in KNOWN_KINDS, m["_file"]
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", m["metadata"]["name"]), m["_file"]
    assert len({(m["kind"], m["metadata"]["name"]) for m in manifests}) == len(manifests)


def test_vendored_schema_is_the_shared_crds_v1(schema):
    if not SHARED_CRD.exists():
        pytest.skip(f"{SHARED_CRD} not on this machine")
    crd = yaml.safe_load(SHARED_CRD.read_text())
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    assert v1["schema"]["openAPIV3Schema"] == schema


def test_rayservice_validates_against_the_crd(rayservice, schema):
    jsonschema.Draft7Validator(schema).validate(rayservice)
    assert unknown_fields(rayservice, schema) == []


def test_schema_checks_catch_mistakes(rayservice, schema):
    """The two checks above do fail on a wrong type and on a misspelled field."""
    bad = copy.deepcopy(rayservice)
    bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replicas"] = "one"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(schema).validate(bad)
    typo = copy.deepcopy(rayservice)
    container = typo["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    assert unknown_fields(typo, schema) == [
        ".spec.rayClusterConfig.workerGroupSpecs[0].template.spec.containers[0].readinesProbe"]


def test_serve_config_v2_is_serve_config_yaml(rayservice, serve_config):
    embedded = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(embedded)
    assert embedded == serve_config


def test_ray_version_and_image(rayservice, ray_pods):
    assert rayservice["spec"]["rayClusterConfig"]["rayVersion"] == ray.__version__
    images = {c["image"] for pod in ray_pods.values() for c in pod["spec"]["containers"]}
    assert len(images) == 1


def test_secret_references_resolve(manifests):
    secrets = by_kind(manifests, "Secret")
    refs = [node["secretKeyRef"] for m in manifests for node in _walk(m) if "secretKeyRef" in node]
    assert refs
    for ref in refs:
        secret = secrets[ref["name"]]
        assert ref["key"] in {**secret.get("data", {}), **secret.get("stringData", {})}, ref


def test_api_key_only_from_the_secret(ray_pods):
    for name, pod in ray_pods.items():
        (container,) = pod["spec"]["containers"]
        (env,) = [e for e in container["env"] if e["name"] == "DSV41_API_KEY"]
        assert "value" not in env and "secretKeyRef" in env["valueFrom"], name


def test_volume_claims_resolve(manifests, ray_pods, app_config):
    claims = by_kind(manifests, "PersistentVolumeClaim")
    checkpoint = app_config["args"]["checkpoint"]
    for name, pod in ray_pods.items():
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        for v in volumes.values():
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in claims, name
        (container,) = pod["spec"]["containers"]
        mounts = [m for m in container["volumeMounts"] if checkpoint.startswith(m["mountPath"] + "/")]
        assert mounts and "persistentVolumeClaim" in volumes[mounts[0]["name"]], name  # the checkpoint is on it


def test_services_select_their_deployments(manifests):
    deployments = by_kind(manifests, "Deployment")
    for name, svc in by_kind(manifests, "Service").items():
        targets = [d for d in deployments.values()
                   if matches(svc["spec"]["selector"], d["spec"]["template"]["metadata"]["labels"])]
        assert len(targets) == 1, name
        pod_ports = {p["name"]: p["containerPort"] for c in targets[0]["spec"]["template"]["spec"]["containers"]
                     for p in c["ports"]}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in pod_ports or port["targetPort"] in pod_ports.values(), name
    for name, d in deployments.items():
        assert matches(d["spec"]["selector"]["matchLabels"], d["spec"]["template"]["metadata"]["labels"]), name


def test_redis_url_names_the_redis_service(manifests, app_config):
    url = urlparse(app_config["runtime_env"]["env_vars"]["DSV41_REDIS_URL"])
    svc = by_kind(manifests, "Service")[url.hostname]
    assert url.port in [p["port"] for p in svc["spec"]["ports"]]


def test_network_policies(manifests, ray_pods):
    policies = by_kind(manifests, "NetworkPolicy")
    redis_pod = by_kind(manifests, "Deployment")["dsv41-redis"]["spec"]["template"]
    redis_port = redis_pod["spec"]["containers"][0]["ports"][0]["containerPort"]
    # Redis: selected, and reachable only from every Ray pod on its port
    redis = policies["dsv41-redis"]["spec"]
    assert matches(redis["podSelector"]["matchLabels"], redis_pod["metadata"]["labels"])
    (rule,) = redis["ingress"]
    assert [p["port"] for p in rule["ports"]] == [redis_port]
    (source,) = rule["from"]
    assert all(matches(source["podSelector"]["matchLabels"], p["metadata"]["labels"]) for p in ray_pods.values())
    # GPU workers: selected (the head is not); all ports from Ray pods; 8000 from anywhere; nothing else open
    workers = policies["dsv41-gpu-workers"]["spec"]
    selected = [n for n, p in ray_pods.items() if matches(workers["podSelector"]["matchLabels"], p["metadata"]["labels"])]
    assert selected == [n for n in ray_pods if n != "head"]
    open_to_all = [p["port"] for r in workers["ingress"] if "from" not in r for p in r["ports"]]
    assert open_to_all == [8000]
    from_ray = [r for r in workers["ingress"] if "ports" not in r]
    assert len(from_ray) == 1 and all(
        matches(from_ray[0]["from"][0]["podSelector"]["matchLabels"], p["metadata"]["labels"]) for p in ray_pods.values())


def test_probes_hit_the_serve_port(gpu_group, serve_config):
    (container,) = gpu_group["template"]["spec"]["containers"]
    serve_port = {p["name"]: p["containerPort"] for p in container["ports"]}["serve"]
    assert serve_port == serve_config["http_options"]["port"]
    paths = {}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["port"] in (serve_port, "serve"), probe
        paths[probe] = get["path"]
    assert paths == {"startupProbe": "/healthz", "readinessProbe": "/readyz", "livenessProbe": "/healthz"}
    assert set(paths.values()) <= set(OPEN_ROUTES)  # answered without the API key


def test_termination_grace_exceeds_the_drain(ray_pods, app_config):
    drain = max([app_config["args"]["graceful_shutdown_timeout_s"]]
                + [d["graceful_shutdown_timeout_s"] for d in app_config["deployments"]])
    for name, pod in ray_pods.items():
        assert pod["spec"]["terminationGracePeriodSeconds"] > drain, name


def test_gpu_worker_resources(gpu_group, app_config):
    (container,) = gpu_group["template"]["spec"]["containers"]
    req, lim = container["resources"]["requests"], container["resources"]["limits"]
    assert int(req["nvidia.com/gpu"]) == int(lim["nvidia.com/gpu"]) == 8
    engram = next(r.num_bytes for r in parameter_report(full_config()) if r.component == "Engram tables")
    object_store = int(gpu_group["rayStartParams"]["object-store-memory"])
    (shm,) = [v for v in gpu_group["template"]["spec"]["volumes"] if v["name"] == "dshm"]
    memory, shm_bytes = quantity_bytes(req["memory"]), quantity_bytes(shm["emptyDir"]["sizeLimit"])
    assert memory >= 512 << 30
    assert shm_bytes >= engram + (64 << 30)  # the node's one copy of the Engram tables lives there, beside NCCL's
    assert memory > object_store + shm_bytes
    assert quantity_bytes(lim["memory"]) >= memory
    # one engine replica per worker pod (a pod without one has no proxy for its probes)
    assert gpu_group["minReplicas"] <= gpu_group["replicas"] == app_config["args"]["num_replicas"]
    assert gpu_group["replicas"] <= gpu_group["maxReplicas"]


def test_gpu_worker_transport_environment(gpu_group):
    (container,) = gpu_group["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert (env["NCCL_NVLS_ENABLE"], env["TORCH_SYMM_MEM_DISABLE_MULTICAST"], env["NVSHMEM_DISABLE_NVLS"]) == ("0", "1", "1")
    tls = env["UCX_TLS"].split(",")
    assert tls[0] == "rc" and "tcp" in tls  # RDMA first, TCP fallback
