"""Ray for the serve tests: one in-process Ray instance and one Serve instance per test session.

Ray 2.60 turns token auth on by default; tests run with RAY_AUTH_MODE=disabled (set before ray.init).
Serve's HTTP proxy listens on 127.0.0.1 at a free port (`serve_session` returns it), never on 8000.
Deployments are per test module: `serve.run(app, name=<unique>, route_prefix=None)`, deleted by the module.
"""

from __future__ import annotations

import os
import socket

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def ray_session():
    """ray.init once (4 logical CPUs, no dashboard); shut down at the end of the session."""
    import ray

    saved = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    ray.init(num_cpus=4, include_dashboard=False, namespace="dsv41-tests", configure_logging=False)
    yield ray
    ray.shutdown()
    if saved is None:
        os.environ.pop("RAY_AUTH_MODE", None)
    else:
        os.environ["RAY_AUTH_MODE"] = saved


@pytest.fixture(scope="session")
def serve_session(ray_session) -> int:
    """Serve started on the session's Ray, its proxy on 127.0.0.1:<free port>; returns the port."""
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield port
    serve.shutdown()
