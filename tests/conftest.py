"""Shared fixtures. TRITON_INTERPRET must be set before any @triton.jit decorator runs (CPU machines).

Ray for the tests that deploy the app (tests/serve, tests/reliability): one in-process Ray instance and one
Serve instance per test session. Ray 2.60 turns token auth on by default; tests run with
RAY_AUTH_MODE=disabled (set before ray.init). Serve's HTTP proxy listens on 127.0.0.1 at a free port
(`serve_session` returns it), never on 8000. Deployments are per test module:
`serve.run(app, name=<unique>, route_prefix=...)`, deleted by the module.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
# Serve's proxy actor must answer its readiness check within 5 s, three times, or the controller kills it and
# serve.start raises (seen under load on a 2-core machine: ActorDiedError "killed by ray.kill" at setup); the
# tests' Ray (started by this process, so its workers inherit the environment) gives it a minute
os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
# torch on one intra-op thread, here and in the processes the tests start (the CLI, subprocess checks): on a
# busy 2-core machine the thread barrier makes the tiny model's many small CPU ops 5-15x slower (measured 2026-12-06:
# `python -m engine.run` on a 27-token prompt and 11 forced ids, 34 s on torch's default 2 threads, 7 s on 1, the
# dumped logits identical). Set before torch is imported; a value already in the environment is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import socket  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

TINY_SEED = 0


def pytest_configure(config):
    if os.environ.get("TRITON_INTERPRET") == "1":  # a device function call no longer re-patches triton.language
        from tests.triton_interpret import skip_dead_overflow_checks, skip_repeated_lang_patches

        skip_repeated_lang_patches()
        skip_dead_overflow_checks()  # the interpreter's int32 overflow checks assert nothing unless debug is on


# `make test` runs the suite in two parts: the tests marked `serial` here (those that start Ray: the session's Ray and
# Serve, or a Ray cluster of their own; and tests/reliability, whose faults come with deadlines) alone, one after
# another, and the rest beside each other on two pytest-xdist workers (--dist loadfile, so a module's fixtures are
# built once). Ray's tests ran slowly and timed out with two Ray clusters up or with interpreter-bound tests beside
# them on a 2-core machine.
RAY_FIXTURES = {"ray_session", "serve_session"}
RAY_MODULES = {"test_kv_serving.py", "test_kv_blocks.py", "test_kv_serving_gpu.py", "test_kv_gpu_pull.py",
               "test_deploy_local.py"}
RELIABILITY = Path(__file__).parent / "reliability"


@pytest.hookimpl(tryfirst=True)  # before the mark plugin's hook, which deselects by -m
def pytest_collection_modifyitems(config, items):
    for item in items:
        path = Path(item.path)
        if (RAY_FIXTURES & set(getattr(item, "fixturenames", ())) or path.name in RAY_MODULES
                or RELIABILITY in path.parents):
            item.add_marker(pytest.mark.serial)


@pytest.fixture(scope="session")
def tiny_cfg():
    """The tiny preset (spec section 8): every layer role at CPU-friendly sizes, real vocabulary."""
    from engine.presets import tiny_config

    return tiny_config()


@pytest.fixture(scope="session")
def tok(tmp_path_factory):
    """The V4.1 tokenizer as a checkpoint folder holds it (read-only by convention; tests that write beside
    the tokenizer file, such as Engram's token-map cache, make their own)."""
    from engine.tokenizer import load_tokenizer, write_tokenizer_files

    out = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer_files(out)
    return load_tokenizer(out)


@pytest.fixture
def one_torch_thread():
    """torch on one intra-op thread for the test, whatever OMP_NUM_THREADS says: on a busy 2-core machine the thread
    barrier makes thousands of small CPU ops ~10x slower. Use with `pytest.mark.usefixtures("one_torch_thread")`."""
    import torch

    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.fixture(scope="session")
def tiny_seed() -> int:
    return TINY_SEED


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, tiny_cfg) -> Path:
    """A random-weight tiny checkpoint in the released format (seed TINY_SEED), written once per session.

    Read-only by convention: tests that corrupt a checkpoint work on a copy.
    """
    from engine.tools.make_checkpoint import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("tiny_checkpoint"), tiny_cfg, seed=TINY_SEED)


@pytest.fixture(scope="session")
def tiny_vision_checkpoint(tmp_path_factory) -> Path:
    """The tiny-vision preset's checkpoint (seed TINY_SEED): the embedded default that `make serve` serves. Its
    text tensors are the tiny checkpoint's, byte for byte; read-only by convention."""
    from engine.presets import tiny_vision_config
    from engine.tools.make_checkpoint import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("tiny_vision_checkpoint"), tiny_vision_config(), seed=TINY_SEED)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def ray_session():
    """ray.init once (4 logical CPUs, no dashboard); shut down at the end of the session."""
    import ray

    if ray.is_initialized():  # an earlier test's own Ray that it failed to shut down: say so, then start ours
        warnings.warn("ray_session: a Ray started by an earlier test was still up; shutting it down")
        ray.shutdown()
    saved = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    ray.init(num_cpus=4, include_dashboard=False, namespace="dsv41-tests", configure_logging=False)
    yield ray
    ray.shutdown()
    from engine.shared_tables import SHM_DIR, sweep

    sweep(SHM_DIR, keep="")  # Engram tables a force-killed replica's shards left unheld (none held: Ray is down)
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
