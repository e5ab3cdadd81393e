"""Build and load the CUDA C++ kernels of `cuda/` (extern "C" launchers, called through ctypes).

`load(name)` compiles `cuda/<name>.cu` into a shared library on first use and caches it under
$DSV41_CUDA_CACHE (default ~/.cache/dsv41/cuda), keyed by a hash of the source, the shared headers
(`cuda/*.cuh`), the nvcc version and the flags, so an edited source or header or another toolkit rebuilds. A file lock serialises concurrent builds (two
processes, or pytest workers, starting on one machine); the library is written to a temporary name and
renamed into place, so a reader never sees half a file. cudart is linked statically (nvcc's default): the
library needs no LD_LIBRARY_PATH and shares the driver's primary context, and so torch's streams.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

CUDA_SRC_DIR = Path(__file__).resolve().parents[2] / "cuda"
NVCC_FLAGS = ("-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-gencode=arch=compute_90,code=sm_90",
              "-shared", "-Xcompiler", "-fPIC")


def nvcc_path() -> str | None:
    """nvcc from PATH, else $CUDA_HOME/bin, else /usr/local/cuda/bin; None where there is no toolkit."""
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root and os.access(Path(root) / "bin" / "nvcc", os.X_OK):
            return str(Path(root) / "bin" / "nvcc")
    return None


def cache_dir() -> Path:
    return Path(os.environ.get("DSV41_CUDA_CACHE") or Path.home() / ".cache" / "dsv41" / "cuda")


@lru_cache(maxsize=None)
def _nvcc_version(nvcc: str) -> str:
    return subprocess.run([nvcc, "--version"], check=True, capture_output=True, text=True).stdout


def build(name: str, out_dir: Path | None = None) -> Path:
    """Compile cuda/<name>.cu (if not cached) and return the shared library's path.

    Raises FileNotFoundError without nvcc and RuntimeError (with nvcc's output) when compilation fails.
    """
    src = CUDA_SRC_DIR / f"{name}.cu"
    nvcc = nvcc_path()
    if nvcc is None:
        raise FileNotFoundError("nvcc not found (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin)")
    headers = b"".join(h.read_bytes() for h in sorted(CUDA_SRC_DIR.glob("*.cuh")))  # included by the sources
    key = hashlib.sha256(src.read_bytes() + headers + _nvcc_version(nvcc).encode() + " ".join(NVCC_FLAGS).encode())
    out_dir = out_dir or cache_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    lib = out_dir / f"{name}-{key.hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    with open(out_dir / f"{lib.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if lib.exists():  # another process built it while we waited
            return lib
        fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f".{name}-", suffix=".so")
        os.close(fd)
        try:
            proc = subprocess.run([nvcc, *NVCC_FLAGS, "-o", tmp, str(src)], capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"nvcc failed on {src} ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
            os.replace(tmp, lib)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return lib


@lru_cache(maxsize=None)
def load(name: str) -> ctypes.CDLL:
    """The built library of cuda/<name>.cu, loaded once per process."""
    return ctypes.CDLL(str(build(name)))


@lru_cache(maxsize=None)
def cuda_kernels_available(device_index: int = 0) -> bool:
    """Whether the kernels of `cuda/` can run on this device: a CUDA device of compute capability >= 9.0 (they
    use sm_90 instructions: clusters, griddepcontrol) and an nvcc to build them."""
    import torch

    return (torch.cuda.is_available() and torch.cuda.get_device_capability(device_index) >= (9, 0)
            and nvcc_path() is not None)


@lru_cache(maxsize=None)
def num_sms(device_index: int = 0) -> int:
    """The device's streaming multiprocessors (launch-shape pickers size their grids by it)."""
    import torch

    return torch.cuda.get_device_properties(device_index).multi_processor_count
