"""engine/kernels/cuda_build.py: the cache key covers the source and the shared headers (cuda/*.cuh)."""

import ctypes

import pytest

from engine.kernels import cuda_build

needs_nvcc = pytest.mark.skipif(cuda_build.nvcc_path() is None, reason="needs nvcc")


@needs_nvcc
def test_editing_a_shared_header_rebuilds(tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    (src / "common.cuh").write_text("#pragma once\nconstexpr int kAnswer = 41;\n")
    (src / "k.cu").write_text('#include "common.cuh"\nextern "C" int dsv41_answer() { return kAnswer + 1; }\n')
    monkeypatch.setattr(cuda_build, "CUDA_SRC_DIR", src)
    first = cuda_build.build("k", tmp_path / "cache")
    assert cuda_build.build("k", tmp_path / "cache") == first, "an unchanged tree must hit the cache"
    (src / "common.cuh").write_text("#pragma once\nconstexpr int kAnswer = 42;\n")
    second = cuda_build.build("k", tmp_path / "cache")
    assert second != first and second.exists(), "a header edit must change the cache key"
    assert ctypes.CDLL(str(second)).dsv41_answer() == 43
