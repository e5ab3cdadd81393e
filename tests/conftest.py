"""Shared fixtures. TRITON_INTERPRET must be set before any @triton.jit decorator runs (CPU machines)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

TINY_SEED = 0


@pytest.fixture(scope="session")
def tiny_cfg():
    """The tiny preset (spec section 8): every layer role at CPU-friendly sizes, real vocabulary."""
    from engine.presets import tiny_config

    return tiny_config()


@pytest.fixture
def one_torch_thread():
    """torch on one intra-op thread for the test: on a busy 2-core machine the thread barrier makes
    thousands of small CPU ops ~10x slower. Use with `pytest.mark.usefixtures("one_torch_thread")`."""
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
