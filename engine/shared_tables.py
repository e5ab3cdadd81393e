"""Engram's tables once per node: one file in shared host memory (/dev/shm) that every process serving the
checkpoint on the node (each rank of a replica, and other replicas) maps read-only.

The released tables are ~203 GB (two Engram layers of ~384M FP8 rows + E8M0 scales): a copy per rank does not
fit a node. The first process to open them copies the tensors' stored bytes straight from the safetensors files
into the file (kernel-side `sendfile`, no tensor materialised on the way; the space is reserved first, so a
/dev/shm too small is an error naming both sizes, never a SIGBUS later). Every process maps it PROT_READ |
MAP_SHARED, so a stray write faults instead of corrupting the other ranks' tables. The tensors are views of the
mapping, row-major as stored, each starting on a page.

Name: `dsv41-engram-<key>`, the key a sha256 of the checkpoint's resolved folder and of each table's file, byte
range, size and mtime: processes serving the same checkpoint share one file; a changed checkpoint gets another.

Locks (flock: per open file, dropped by the kernel when a process dies, so a crash never wedges them):
- `<name>.lock`, held exclusively for the short steps that create the file, map it, or drop the last use;
- the data file itself, held shared by every process that maps it, for as long as it does.
Open: lock; if `<name>` is missing, copy into `<name>.<pid>.tmp` and rename it (so `<name>` is always
complete); map; hold; unlock. Release (`release()`, or when the mapping is collected, or at exit): lock; if an
exclusive hold can then be taken, no other process maps the file: unlink it and the lock file; unlock. Mappings
that still exist stay valid (tmpfs frees the pages at the last munmap). A process killed while mapping leaves the
file unheld: the next open of that key maps it as it is, and any open sweeps other keys' unheld files.

CUDA: the gather kernel reads the tables over PCIe (engine/kernels/engram_gather.py), so they must be
page-locked. `pin()` registers the whole mapping with cudaHostRegister(portable | mapped | read-only): read-only
because the pages are mapped PROT_READ (the driver then pins them without asking for write access; the device
must report cudaDevAttrHostRegisterReadOnlySupported, as Hopper on Linux x86-64 does). cudaPointerGetAttributes
reports registered memory as cudaMemoryTypeHost, so `Tensor.is_pinned()` is True and HostEngramTable uses the
tensors as they are (it would otherwise register them itself, without the read-only flag, which fails on these
pages). Each process registers its own mapping (several processes may pin the same pages); the registration is
undone when this object is collected, not by `release()`. Not yet run on a GPU: tests/gpu/test_shared_tables.py.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import mmap
import os
import shutil
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from engine.checkpoint.loader import TensorBytes, locate_tensors

SHM_DIR = Path("/dev/shm")
PREFIX = "dsv41-engram-"
COPY_CHUNK = 1 << 30  # bytes per sendfile call
_CUDA_HOST_REGISTER_FLAGS = 0x01 | 0x02 | 0x08  # cudaHostRegisterPortable | Mapped | ReadOnly


class SharedTablesError(RuntimeError):
    """The shared tables cannot be made or mapped; the message names the file and what to change."""


@dataclass(frozen=True, slots=True)
class TableSpec:
    """A tensor's storage dtype and shape (as the model's buffer declares it)."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def file_layout(specs: dict[str, TableSpec]) -> tuple[dict[str, int], int]:
    """Each tensor's byte offset in the file (names sorted, each on a page) and the file's size."""
    offsets, end = {}, 0
    for name in sorted(specs):
        offsets[name] = -(-end // mmap.PAGESIZE) * mmap.PAGESIZE
        end = offsets[name] + specs[name].nbytes
    return offsets, end


def table_key(ckpt_dir: str | Path, sources: dict[str, TensorBytes]) -> str:
    """16 hex digits naming the checkpoint's tables: its folder and each table's file, byte range and version."""
    ident: list[object] = [str(Path(ckpt_dir).resolve())]
    for name in sorted(sources):
        src = sources[name]
        st = src.path.stat()
        ident.append([name, str(src.path.resolve()), src.offset, src.nbytes, st.st_size, st.st_mtime_ns])
    return hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:16]


class SharedTables:
    """Some checkpoint tensors in one node-wide read-only mapping (see the module docstring). `tensors`: name ->
    CPU tensor viewing the mapping. The file stays in use while this object or any of the tensors lives."""

    def __init__(self, path: Path, tensors: dict[str, Tensor], mm: mmap.mmap, nbytes: int, base: int,
                 release: weakref.finalize):
        self.path, self.tensors, self.nbytes = path, tensors, nbytes
        self._mm, self._base, self._release = mm, base, release
        self._unregister: weakref.finalize | None = None

    @classmethod
    def open(cls, ckpt_dir: str | Path, specs: dict[str, TableSpec], directory: Path = SHM_DIR) -> "SharedTables":
        """Map the named tensors of a validated checkpoint, copying them into `directory` first if no process
        on this node has. Raises SharedTablesError (no room, a damaged file) naming the file."""
        sources = locate_tensors(ckpt_dir, specs)
        for name, spec in specs.items():
            if sources[name].nbytes != spec.nbytes:
                raise SharedTablesError(f"tensor {name} is stored in {sources[name].nbytes} bytes; {spec.dtype} "
                                        f"{list(spec.shape)} needs {spec.nbytes}")
        offsets, size = file_layout(specs)
        name = PREFIX + table_key(ckpt_dir, sources)
        path, lock_path = directory / name, directory / f"{name}.lock"
        sweep(directory, keep=name)
        lock = _lock(lock_path)
        try:
            for stale in directory.glob(f"{name}.*.tmp"):  # a creator that died: its lock is ours now
                stale.unlink(missing_ok=True)
            if not path.exists():
                _create(path, sources, offsets, size)
            fd = os.open(path, os.O_RDONLY)
            try:
                if (found := os.fstat(fd).st_size) != size:
                    raise SharedTablesError(f"{path} holds {found} bytes where the tables take {size}: not ours, "
                                            "or damaged; delete it")
                mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
                fcntl.flock(fd, fcntl.LOCK_SH)  # this process maps the file: no one unlinks it
            except BaseException:
                os.close(fd)
                raise
        finally:
            os.close(lock)
        release = weakref.finalize(mm, _release, fd, path, lock_path)
        tensors = {n: _view(mm, offsets[n], specs[n]) for n in specs}
        base = _view(mm, 0, TableSpec(torch.uint8, (1,))).data_ptr()
        return cls(path, tensors, mm, size, base, release)

    def pin(self) -> None:
        """Page-lock the whole mapping for CUDA reads (once; see the module docstring)."""
        if self._unregister is not None:
            return
        torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(self._base, self.nbytes,
                                                                    _CUDA_HOST_REGISTER_FLAGS))
        self._unregister = weakref.finalize(self, _unregister, self._base)
        self._unregister.atexit = False  # at exit the process's memory goes anyway (and CUDA may be torn down)

    def release(self) -> None:
        """Give up this process's use of the file now (unlinked if no other process maps it; idempotent). The
        tensors stay valid: the pages live until the last mapping goes."""
        self._release()


def backing_file(ptr: int) -> tuple[str, int] | None:
    """(path, inode) of the file mapped at address ptr in this process, per /proc/self/maps (inode 0 and an
    empty or bracketed path for anonymous memory); None where nothing is mapped."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= ptr < hi:
                return (fields[5].strip() if len(fields) > 5 else ""), int(fields[4])
    return None


def sweep(directory: Path, keep: str) -> None:
    """Remove other keys' files that no process maps nor is creating (left by processes that were killed)."""
    for lock_path in directory.glob(f"{PREFIX}*.lock"):
        name = lock_path.name.removesuffix(".lock")
        if name == keep:
            continue
        try:
            fd = os.open(lock_path, os.O_RDWR)
        except FileNotFoundError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # being created, opened or released right now
            if _same_file(lock_path, fd) and not _is_held(directory / name):
                for stale in directory.glob(f"{name}.*.tmp"):
                    stale.unlink(missing_ok=True)
                (directory / name).unlink(missing_ok=True)
                lock_path.unlink(missing_ok=True)
        finally:
            os.close(fd)


# ---- internals ----------------------------------------------------------------------------------------------
def _view(mm: mmap.mmap, offset: int, spec: TableSpec) -> Tensor:
    with warnings.catch_warnings():  # read-only by design (PROT_READ): torch warns it cannot write through it
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        flat = torch.frombuffer(mm, dtype=torch.uint8, count=spec.nbytes, offset=offset)
    return flat.view(spec.dtype).view(spec.shape)


def _create(path: Path, sources: dict[str, TensorBytes], offsets: dict[str, int], size: int) -> None:
    """Copy every source's bytes to its offset in a new file, then rename it to `path` (the lock is held)."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            free = shutil.disk_usage(path.parent).free
            raise SharedTablesError(f"{path.parent} cannot hold the Engram tables ({e.strerror}): {size} bytes "
                                    f"needed, {free} free; enlarge it (docker --shm-size, or a k8s emptyDir with "
                                    "medium: Memory and a sizeLimit above the tables)") from None
        for name, src in sources.items():
            with open(src.path, "rb") as f:
                _copy(f.fileno(), fd, src.offset, offsets[name], src.nbytes)
        os.rename(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)


def _copy(src_fd: int, dst_fd: int, src_offset: int, dst_offset: int, nbytes: int) -> None:
    os.lseek(dst_fd, dst_offset, os.SEEK_SET)
    done = 0
    while done < nbytes:
        n = os.sendfile(dst_fd, src_fd, src_offset + done, min(COPY_CHUNK, nbytes - done))
        if n == 0:
            raise SharedTablesError(f"a checkpoint file ended {nbytes - done} bytes before its tensor did")
        done += n


def _lock(path: Path) -> int:
    """An exclusive flock on `path`, created if missing; retried when the file was unlinked while we waited."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        if _same_file(path, fd):
            return fd
        os.close(fd)


def _same_file(path: Path, fd: int) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _is_held(data: Path) -> bool:
    """Whether any process holds (maps) the data file."""
    try:
        fd = os.open(data, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def _release(fd: int, path: Path, lock_path: Path) -> None:
    """Drop this process's hold (fd) on the data file; unlink the files if it was the last one."""
    lock = _lock(lock_path)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # converts the shared hold: only when no one else holds it
            last = True
        except BlockingIOError:
            last = False
        if last:
            path.unlink(missing_ok=True)
            lock_path.unlink(missing_ok=True)
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)  # explicitly: the mmap's own dup of fd shares the lock, and may outlive fd
        os.close(fd)
        os.close(lock)


def _unregister(ptr: int) -> None:
    torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(ptr))
