"""serve_config.yaml deployed for real, the way an operator does it: `ray start --head`, `serve deploy` through
the dashboard, wait for /readyz, chat over HTTP, `serve shutdown`, stop Ray.

Only what a CPU machine needs is rewritten: the checkpoint (the tiny one), the device, the KV budget and the
HTTP address. Isolation from other Ray clusters on the machine: free ports, a private --temp-dir (so no
other process's `ray.init()` finds this cluster), and teardown by process id (`ray start --block` in its own
session) instead of `ray stop`, which would stop every Ray process on the machine.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from .ops_files import DASHBOARD, dashboard_series

BIN = Path(sys.executable).parent
API_KEY = "ops-test-key"
LONG_PROMPT = " ".join(["The quick brown fox jumps over the lazy dog."] * 20)  # > 3 full 64-token blocks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_port_window(size: int = 200) -> tuple[int, int]:
    """A window below the ephemeral range whose first and last ports are free (other tests may run Ray too)."""
    rng = random.Random()
    for _ in range(50):
        lo = rng.randrange(22000, 32000 - size)
        try:
            for port in (lo, lo + size - 1):
                with socket.socket() as s:
                    s.bind(("0.0.0.0", port))
        except OSError:
            continue
        return lo, lo + size - 1
    raise RuntimeError("no free worker port window")


class LocalRay:
    """A `ray start --head --block` in its own session and temp dir; stop() ends exactly its processes."""

    def __init__(self, tmp: Path, env: dict[str, str]):
        self.tmp, self.env = tmp, env
        self.dashboard_port, self.http_port = free_port(), free_port()
        lo, hi = worker_port_window()
        self.log = (tmp / "ray_start.log").open("w")
        self.proc = subprocess.Popen(
            [str(BIN / "ray"), "start", "--head", "--block", "--disable-usage-stats", "--num-cpus", "4",
             "--temp-dir", str(tmp / "ray"), "--port", str(free_port()),
             "--dashboard-host", "127.0.0.1", "--dashboard-port", str(self.dashboard_port),
             "--ray-client-server-port", str(free_port()), "--dashboard-agent-listen-port", str(free_port()),
             "--metrics-export-port", str(free_port()), "--min-worker-port", str(lo), "--max-worker-port", str(hi)],
            env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def wait_for_dashboard(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"ray start exited:\n{self.log_tail()}"
            try:
                if httpx.get(f"{self.dashboard}/api/version", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"no dashboard after {timeout_s} s:\n{self.log_tail()}")

    def serve(self, *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run([str(BIN / "serve"), *args, "--address", self.dashboard], env=self.env,
                              capture_output=True, text=True, timeout=timeout_s)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # `ray start --block` stops the processes it started
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        for pid in _session_members(self.proc.pid):  # anything left in the session we created
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.log.close()

    def log_tail(self, n: int = 40) -> str:
        self.log.flush()
        return "\n".join((self.tmp / "ray_start.log").read_text().splitlines()[-n:])


def _session_members(sid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == sid:
                    out.append(int(entry))
            except (ProcessLookupError, PermissionError):
                pass
    return out


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalRay]:
    tmp = Path(tempfile.mkdtemp(prefix="dsv41ops-", dir="/tmp"))  # short: Ray's socket paths live under it
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_AUTH_MODE="disabled", DSV41_API_KEY=API_KEY, RAY_metrics_report_interval_ms="1000")
    ray = LocalRay(tmp, env)
    try:
        ray.wait_for_dashboard(90)
        yield ray
    finally:
        ray.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def cpu_config(source: Path, checkpoint: Path, http_port: int) -> dict:
    """serve_config.yaml with the CPU machine's checkpoint, device, KV budget and HTTP address."""
    config = yaml.safe_load(source.read_text())
    config["http_options"].update(host="127.0.0.1", port=http_port)
    (app,) = config["applications"]
    app["args"].update(checkpoint=str(checkpoint), device="cpu", cache_memory_bytes="64MiB")
    return config


def wait_ready(url: str, timeout_s: float, ray: LocalRay) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            if httpx.get(f"{url}/readyz", timeout=5).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    status = ray.serve("status").stdout
    raise TimeoutError(f"/readyz not 200 after {timeout_s} s; serve status:\n{status}\n{ray.log_tail()}")


def chat(url: str, content: str, key: str | None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    body = {"model": "deepseek-v4.1-flash", "max_tokens": 4, "reasoning_effort": "none",
            "messages": [{"role": "user", "content": content}]}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60)


def scraped_series(url: str, wanted: set[str], timeout_s: float) -> set[str]:
    """Series names seen on /metrics over a few scrapes (gauges show for two report intervals after a set)."""
    seen: set[str] = set()
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s and not wanted <= seen:
        text = httpx.get(f"{url}/metrics", headers={"authorization": f"Bearer {API_KEY}"}, timeout=10).text
        seen |= {line.split("{", 1)[0].split(" ", 1)[0] for line in text.splitlines() if not line.startswith("#")}
        time.sleep(0.5)
    return seen


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_serve_deploy_on_a_local_cluster(cluster, tiny_checkpoint, tmp_path):
    repo = Path(__file__).resolve().parents[2]
    config_path = tmp_path / "serve_config.yaml"
    config_path.write_text(yaml.safe_dump(cpu_config(repo / "serve_config.yaml", tiny_checkpoint, cluster.http_port)))
    url = f"http://127.0.0.1:{cluster.http_port}"
    try:
        deployed = cluster.serve("deploy", str(config_path))
        assert deployed.returncode == 0, deployed.stdout + deployed.stderr
        ready_s = wait_ready(url, 150, cluster)

        apps = httpx.get(f"{cluster.dashboard}/api/serve/applications/", timeout=10).json()["applications"]
        app = apps["dsv41"]
        assert app["status"] == "RUNNING"
        assert {d for d in app["deployments"]} == {"OpenAIIngress", "EngineReplica"}
        engine = app["deployments"]["EngineReplica"]["deployment_config"]
        assert engine["graceful_shutdown_timeout_s"] == 120 and engine["max_surge_percent"] == 100

        assert chat(url, "Say hello.", key=None).status_code == 401  # DSV41_API_KEY reached the app
        first = chat(url, LONG_PROMPT, key=API_KEY)
        assert first.status_code == 200, first.text
        body = first.json()
        assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] == 4
        again = chat(url, LONG_PROMPT, key=API_KEY).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the local prefix cache

        wanted = dashboard_series(json.loads(DASHBOARD.read_text()))
        seen = scraped_series(url, wanted, timeout_s=20)
        assert wanted <= seen, f"queried by the dashboard but never exported: {sorted(wanted - seen)}"
        print(f"ready {ready_s:.1f} s after serve deploy")
    finally:
        shutdown = cluster.serve("shutdown", "-y")
    assert shutdown.returncode == 0, shutdown.stdout + shutdown.stderr
