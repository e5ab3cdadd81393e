"""Fixtures of the kernel tests."""

import pytest

from engine.presets import full_config
from engine.tools.random_moe import random_moe


@pytest.fixture(scope="module")
def full_moe():
    """The released layer shape (384 experts x 3 FP4 [2304 x 5120] matrices, 7.2 GB) with random codes and
    scales, built on the GPU."""
    return random_moe(full_config())
