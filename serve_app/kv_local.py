"""Same-node reads of a peer replica's host KV store through shared memory, instead of a NIXL read over UCX.

The owner's HostKVStore buffer is a memfd (an anonymous shared-memory file that lives as long as a process holds
it; nothing is left in /dev/shm after a crash). Its SharedStoreHandle (node, pid, fd, inode, base address, size)
travels in the owner's peer record. A reader on the same node (the same kernel boot and pid namespace) maps the
file read-only through /proc/<pid>/fd/<fd>, checks that the inode is the published one (a reused pid or fd maps
nothing), and copies a pull's blocks out with plain memory copies on several threads: 60 GB/s on the H200 machine's
16 cores with 8 threads, where UCX's loopback READ moved the same bytes at ~6 GB/s. Anything that stops the mapping
(another node, the owner gone, no permission to open its fd) gives None, and the caller reads over NIXL. As a NIXL
READ is, a copy is unverified here: the importer checks every block's checksum where the bytes landed.

Where the reader copies to a CUDA device, the mapping is also registered with CUDA (page-locked, on a thread: the
first pull from a peer does not wait for it), and from then on the importer copies a chunk of adjacent blocks
straight from the owner's memory to the device, with no host copy at all.

A mapping keeps the owner's file alive, so mappings are checked against /proc at each use (an owner that exited is
dropped) and at most MAX_MAPPINGS are kept, least recently used dropped first. One pull runs at a time per process
(the replica's pull thread or the shard actor's pull group), so a mapping is not dropped while a pull copies from it.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import numpy as np
import torch

COPY_THREADS = max(1, min(8, os.cpu_count() or 1))
MIN_PIECE_BYTES = 256 << 10  # a copy is split over threads into pieces of at least this (a thread hop costs ~20 us)
MAX_MAPPINGS = 8
logger = logging.getLogger("dsv41.kv")


@dataclass(frozen=True, slots=True)
class SharedStoreHandle:
    """What a same-node reader needs to map an owner's store (JSON-able: it rides in the peer record)."""

    node: str  # this_node() of the owner
    pid: int
    fd: int
    inode: int
    base: int  # the buffer's address in the owner's process: a BlockRef's address - base is its offset
    nbytes: int

    def doc(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_doc(cls, doc: dict[str, object]) -> "SharedStoreHandle":
        return cls(str(doc["node"]), int(doc["pid"]), int(doc["fd"]), int(doc["inode"]), int(doc["base"]),
                   int(doc["nbytes"]))


def this_node() -> str:
    """Who can open another process's fd through /proc: the same kernel boot and the same pid namespace."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"


class SharedBuffer:
    """A page-aligned buffer of nbytes that same-node peers can map: a memfd where Linux has one (handle() then
    describes it), else private anonymous memory (handle() is None: peers read over NIXL)."""

    def __init__(self, nbytes: int, name: str = "dsv41-kv-store"):
        self.fd: int | None = None
        if hasattr(os, "memfd_create") and os.path.exists("/proc/self/ns/pid"):
            self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
            weakref.finalize(self, os.close, self.fd)  # peers open it by number while this buffer lives
            os.ftruncate(self.fd, nbytes)
            self.mmap = mmap.mmap(self.fd, nbytes)
        else:
            self.mmap = mmap.mmap(-1, nbytes)
        self.array = np.frombuffer(self.mmap, dtype=np.uint8)

    def handle(self) -> SharedStoreHandle | None:
        if self.fd is None:
            return None
        return SharedStoreHandle(this_node(), os.getpid(), self.fd, os.fstat(self.fd).st_ino, self.array.ctypes.data,
                                 self.array.nbytes)


@dataclass(slots=True)
class MappedStore:
    """A peer's store as this process maps it: array (uint8 [nbytes]) and, where this process copies to a CUDA
    device, the same memory page-locked (registered with CUDA) as rows the device copies from directly, once the
    registration (started by the first such map, on a thread of its own) has ended."""

    array: np.ndarray
    page_locked: torch.Tensor | None = None  # uint8 [nbytes] over array's memory, registered
    locking: threading.Thread | None = None  # the registration, tried once per mapping

    def wait_locked(self, timeout_s: float | None = None) -> bool:
        """Whether the store is page-locked, after waiting up to timeout_s for a registration under way."""
        if self.locking is not None:
            self.locking.join(timeout_s)
        return self.page_locked is not None

    def start_locking(self) -> None:
        """Registers the mapping with CUDA on a thread, for this process's current device (once; no wait): it
        takes ~60 ms per GiB of store on the H100 machine, which a pull should not wait for (a pull before it
        ends copies through the staging buffer)."""
        if self.locking is not None:
            return
        device = torch.cuda.current_device()

        def register() -> None:
            torch.cuda.set_device(device)
            self.page_locked = _register(self.array)

        self.locking = threading.Thread(target=register, name="kv-peer-register", daemon=True)
        self.locking.start()

    def release(self) -> None:
        if self.locking is not None:
            self.locking.join()
        if self.page_locked is not None:
            torch.cuda.cudart().cudaHostUnregister(self.array.ctypes.data)
            self.page_locked = None


class PeerStores:
    """This process's mappings of peers' stores (thread-safe)."""

    def __init__(self):
        self._maps: OrderedDict[SharedStoreHandle, MappedStore] = OrderedDict()
        self._lock = threading.Lock()
        self._node: str | None = None

    def map(self, handle: SharedStoreHandle, page_locked: bool = False) -> MappedStore | None:
        """The owner's whole buffer, or None if it cannot be mapped from here. page_locked: also register it with
        CUDA (MappedStore.start_locking: once per mapping, in the background), so a device copies from it without
        staging once that has ended; if registering fails, the mapping stays without (copies then go through the
        staging buffer)."""
        page_locked = page_locked and torch.cuda.is_available()
        with self._lock:
            if self._node is None:
                self._node = this_node()
            if handle.node != self._node:
                return None
            path = f"/proc/{handle.pid}/fd/{handle.fd}"
            try:
                alive = os.stat(path).st_ino == handle.inode
            except OSError:
                alive = False
            mapped = self._maps.pop(handle, None)
            if not alive:
                if mapped is not None:
                    mapped.release()
                return None
            if mapped is None or (page_locked and not mapped.array.flags.writeable):
                if mapped is not None:
                    mapped.release()
                array = _map(path, handle, writable=page_locked)
                if array is None:
                    return None
                mapped = MappedStore(array)
            if page_locked:
                mapped.start_locking()
            self._maps[handle] = mapped
            while len(self._maps) > MAX_MAPPINGS:
                self._maps.popitem(last=False)[1].release()
            return mapped


def _map(path: str, handle: SharedStoreHandle, writable: bool) -> np.ndarray | None:
    """Read-only, unless it is to be registered with CUDA: registering pins pages for writing, which a read-only
    mapping refuses. Nothing here writes through it: the device only reads from it."""
    try:
        fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC)
    except OSError:  # e.g. no permission to open another user's fd
        return None
    try:
        st = os.fstat(fd)
        if st.st_ino != handle.inode or st.st_size < handle.nbytes:
            return None
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        return np.frombuffer(mmap.mmap(fd, handle.nbytes, prot=prot), dtype=np.uint8)
    finally:
        os.close(fd)  # the mapping holds the file


def _register(array: np.ndarray) -> torch.Tensor | None:
    rc = torch.cuda.cudart().cudaHostRegister(array.ctypes.data, array.nbytes, 1)  # 1: cudaHostRegisterPortable
    if int(rc) != 0:
        logger.warning("cannot page-lock a peer's KV store (%d B): %s; its blocks go through the staging buffer",
                       array.nbytes, rc)
        return None
    return torch.from_numpy(array)


def block_runs(addresses: Sequence[int], nbytes: int) -> list[tuple[int, int]]:
    """(first index, count) of each run of adjacent blocks (addresses[i + 1] == addresses[i] + nbytes), in order:
    what one read or copy can move at once (a stored chain usually is one run)."""
    runs, start = [], 0
    for i in range(1, len(addresses) + 1):
        if i == len(addresses) or addresses[i] != addresses[i - 1] + nbytes:
            runs.append((start, i - start))
            start = i
    return runs


peer_stores = PeerStores()
_copier: ThreadPoolExecutor | None = None
_copier_lock = threading.Lock()


def copy_blocks(src: np.ndarray, base: int, addresses: Sequence[int], dst: np.ndarray) -> None:
    """dst[i] = the block at owner address addresses[i] (offset addresses[i] - base in src, the mapped store);
    dst: uint8 [len(addresses), block_bytes], C-contiguous. Runs of adjacent blocks are copied as one range, split
    over COPY_THREADS threads."""
    n, nbytes = dst.shape
    assert len(addresses) == n and dst.dtype == np.uint8 and dst.flags.c_contiguous, f"dst {dst.dtype} {dst.shape}"
    flat = dst.reshape(-1)
    pieces: list[tuple[int, int, int]] = []  # (dst offset, src offset, length)
    piece = max(MIN_PIECE_BYTES, -(-dst.nbytes // COPY_THREADS))
    for start, count in block_runs(addresses, nbytes):
        src_off, length = addresses[start] - base, count * nbytes
        assert 0 <= src_off and src_off + length <= src.nbytes, f"blocks at {src_off}+{length} outside the store"
        for at in range(0, length, piece):
            pieces.append((start * nbytes + at, src_off + at, min(piece, length - at)))

    def copy(p: tuple[int, int, int]) -> None:
        d, s, length = p
        flat[d:d + length] = src[s:s + length]

    if len(pieces) == 1:
        copy(pieces[0])
        return
    global _copier
    with _copier_lock:
        if _copier is None:
            _copier = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="kv-copy")
    for _ in _copier.map(copy, pieces):  # numpy's copies release the GIL
        pass
