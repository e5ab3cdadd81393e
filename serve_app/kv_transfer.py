"""One-sided reads of another replica's host KV store over NIXL (UCX backend); the only module that
imports nixl.

Each replica runs one TransferAgent: it registers its HostKVStore's buffer (so peers can read it) and a
staging buffer (where its own pulls land). A pull connects to the owner by its agent metadata (from the
ownership index, once per peer), posts one READ of all the blocks' descriptors, polls until done or
the deadline, and verifies every block's checksum. Any failure (unknown or dead peer, a NIXL error, the
deadline, a checksum mismatch) is a TransferFailed: the caller recomputes.

A pull into the pools goes through PeerBlockReader instead: from the owner's shared memory when it is on this node
(kv_local.py), else NIXL READs without the host checks, which the importer does on the device.

UCX notes (shared/spec/environment.md): leave UCX_TLS unset or include tcp (`sm,self` alone hangs at
connect); the first transfer to a peer pays the connection wire-up (tens to hundreds of ms).
"""

from __future__ import annotations

import mmap
import os
import socket
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from nixl_cu13 import nixl_agent, nixl_agent_config  # the CUDA 13 build pyproject pins (imports numpy, not torch)

from engine.core.block_checksum import checksum_value
from serve_app.kv_local import MappedStore, SharedStoreHandle, block_runs, copy_blocks, peer_stores
from serve_app.kv_store import BlockRef, HostKVStore, block_checksums

DEFAULT_TIMEOUT_S = 5.0


class TransferFailed(RuntimeError):
    """A pull did not deliver verified blocks; nothing usable was written."""


class TransferAgent:
    """One per replica process. Not thread-safe (NIXL's agent runs without locks here): make every
    call from one thread, e.g. the replica's pull worker."""

    def __init__(self, name: str, store: HostKVStore | None = None, staging_bytes: int = 64 << 20):
        """name: unique among live agents (e.g. replica id + pid). store: its buffer becomes readable by
        peers. staging_bytes: initial size of the pull buffer (grows to the largest pull)."""
        self.name = name
        self._agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
        # UCX picks its transports from UCX_TLS (the node's environment: ray_cluster.yaml, k8s/rayservice.yaml);
        # unset, it uses every transport it finds. UCX_LOG_LEVEL=info logs the lanes it actually chose. One line on
        # stderr (the replica's or shard actor's log), as a shard's memory line is
        print(f"NIXL agent {name}: UCX backend, UCX_TLS={os.environ.get('UCX_TLS', 'unset (all found)')}",
              file=sys.stderr, flush=True)
        self._peers: dict[bytes, str] = {}  # agent metadata -> remote agent name
        self._registered: list[tuple[np.ndarray, object]] = []  # (buffer kept alive, its NIXL registration)
        if store is not None:
            self._register(store.buffer)
        self._staging = self._new_staging(staging_bytes)
        self.num_pulls = self.num_bytes_pulled = 0
        self.pull_time = 0.0

    @property
    def metadata(self) -> bytes:
        """What a peer needs to read this agent's registered memory (~0.5 kB); publish it."""
        return self._agent.get_agent_metadata()

    def connect(self, metadata: bytes) -> str:
        """Loads a peer's metadata and starts the UCX wire-up in the background (once per peer); returns
        its agent name. Call it ahead of the first pull: that then takes ~15 ms instead of 0.1-0.7 s."""
        name = self._peers.get(metadata)
        if name is None:
            try:
                raw = self._agent.add_remote_agent(metadata)
                name = raw.decode() if isinstance(raw, bytes) else raw
                self._agent.make_connection(name)
            except Exception as e:  # nixl raises its own exception types from C++
                raise TransferFailed(f"cannot connect to the peer its metadata names: {e!r}") from e
            self._peers[metadata] = name
        return name

    def disconnect(self, metadata: bytes) -> None:
        name = self._peers.pop(metadata, None)
        if name is not None:
            self._agent.remove_remote_agent(name)

    def pull(self, peer_metadata: bytes, blocks: Sequence[BlockRef], dst: np.ndarray | None = None,
             timeout_s: float = DEFAULT_TIMEOUT_S, verify: bool = True) -> np.ndarray:
        """Reads the peer's blocks (in order) into dst, a uint8 [len(blocks), nbytes] view of memory
        registered with this agent (default: the staging buffer; copy the result out before the next
        pull). Returns the view once the read ended and (verify) every block's checksum matches; raises
        TransferFailed. verify=False leaves the checks to the caller (the importer checks on the device)."""
        if not blocks:
            return np.empty((0, 0), np.uint8)
        nbytes = blocks[0].nbytes
        assert all(b.nbytes == nbytes for b in blocks), "blocks of one pull have one size"
        if dst is None:
            if self._staging.size < len(blocks) * nbytes:
                self._deregister(self._staging)
                self._staging = self._new_staging(len(blocks) * nbytes)
            dst = self._staging[:len(blocks) * nbytes].reshape(len(blocks), nbytes)
        assert dst.dtype == np.uint8 and dst.shape == (len(blocks), nbytes) and dst.flags.c_contiguous, \
            f"dst {dst.dtype} {dst.shape}"
        t0 = time.perf_counter()
        peer = self.connect(peer_metadata)
        local, remote = coalesce_reads(dst.ctypes.data, [b.address for b in blocks], nbytes)
        try:
            handle = self._agent.initialize_xfer("READ", self._agent.get_xfer_descs(local, "DRAM"),
                                                 self._agent.get_xfer_descs(remote, "DRAM"), peer)
        except Exception as e:
            raise TransferFailed(f"pull of {len(blocks)} blocks from {peer}: {e!r}") from e
        state = self._wait(handle, time.monotonic() + timeout_s)
        if state != "DONE":
            if state == "PROC":  # the READ may still land: never hand this buffer out again
                self._quarantine(dst)
            else:  # e.g. the peer died: forget it, a later pull reconnects from fresh metadata
                self.disconnect(peer_metadata)
            why = f"timed out after {timeout_s:.3f} s" if state == "PROC" else state
            raise TransferFailed(f"pull of {len(blocks)} blocks from {peer}: {why}")
        for i, (b, got) in enumerate(zip(blocks, block_checksums(dst) if verify else ())):
            if got != b.checksum:
                raise TransferFailed(f"block {i} ({b.block_hash.hex()[:16]}) from {peer}: checksum mismatch")
        self.num_pulls += 1
        self.num_bytes_pulled += dst.nbytes
        self.pull_time += time.perf_counter() - t0
        return dst

    def register(self, buffer: np.ndarray) -> None:
        """Makes a caller's host buffer (C-contiguous uint8, kept alive by this agent) a pull target; a buffer
        registered already (the same memory) is left as it is."""
        if not any(buf.ctypes.data == buffer.ctypes.data and buf.nbytes == buffer.nbytes
                   for buf, _ in self._registered):
            self._register(buffer)

    def close(self) -> None:
        """Forgets every peer and deregisters every buffer (a pull in flight must have ended)."""
        for metadata in list(self._peers):
            self.disconnect(metadata)
        for _, reg in self._registered:
            self._agent.deregister_memory(reg)
        self._registered.clear()

    # ---- internals ----------------------------------------------------------------------------------
    def _wait(self, handle, deadline: float) -> str:
        """"DONE", "PROC" (still in flight at the deadline), or why it failed."""
        try:
            state = self._agent.transfer(handle)
            polls = 0
            while state == "PROC" and time.monotonic() < deadline:
                polls += 1
                time.sleep(0 if polls < 100 else 1e-4)  # spin briefly (a block takes ~20 us), then back off
                state = self._agent.check_xfer_state(handle)
        except Exception as e:  # e.g. NIXL_ERR_REMOTE_DISCONNECT from a dead peer
            return f"failed: {e!r}"
        if state != "PROC":
            self._agent.release_xfer_handle(handle)
        # a transfer still in flight keeps its handle (releasing it while UCX works on it is undefined)
        return state

    def _register(self, buffer: np.ndarray) -> None:
        assert buffer.dtype == np.uint8 and buffer.flags.c_contiguous, "register a C-contiguous uint8 buffer"
        reg = self._agent.register_memory([(buffer.ctypes.data, buffer.nbytes, 0, "")], "DRAM")
        self._registered.append((buffer, reg))

    def _deregister(self, buffer: np.ndarray) -> None:
        for i, (buf, reg) in enumerate(self._registered):
            if buf is buffer:
                self._agent.deregister_memory(reg)
                del self._registered[i]
                return

    def _new_staging(self, nbytes: int) -> np.ndarray:
        """A page-aligned registered buffer (anonymous mmap; the array keeps the mapping alive)."""
        page = os.sysconf("SC_PAGE_SIZE")
        buf = np.frombuffer(mmap.mmap(-1, max(page, -(-nbytes // page) * page)), dtype=np.uint8)
        self._register(buf)
        return buf

    def _quarantine(self, dst: np.ndarray) -> None:
        # the old buffer stays registered and alive (a late READ may still write it); it is never reused
        if np.shares_memory(dst, self._staging):
            self._staging = self._new_staging(self._staging.size)


_process_agent: TransferAgent | None = None
_process_lock = threading.Lock()


def process_agent() -> TransferAgent:
    """This process's agent for pulls into a staging buffer (a shard actor's), made at the first call. It
    registers no store: nobody reads from it."""
    global _process_agent
    with _process_lock:
        if _process_agent is None:
            _process_agent = TransferAgent(f"import-{socket.gethostname()}-{os.getpid()}", staging_bytes=0)
        return _process_agent


@dataclass(slots=True)
class PeerBlockReader:
    """The owner's blocks as a BlockReader (engine/core/kv_import.py): a small picklable record (the owner's agent
    metadata, its store's SharedStoreHandle, the BlockRefs) that reads each chunk into the importer's buffer, from
    the owner's shared memory when it is on this node (serve_app/kv_local.py), else with one NIXL READ. It does
    not verify: its expected_checksums are checked by the importer where the bytes land. agent: the one to read
    with in this process (the replica's, when its engine is in process); it does not travel: unpickled in a shard
    actor, the reader uses that process's agent. Its failures are TransferFailed (timeout, unreachable owner),
    like TransferAgent.pull's."""

    peer_metadata: bytes
    blocks: list[BlockRef]
    timeout_s: float = DEFAULT_TIMEOUT_S
    shared_store: SharedStoreHandle | None = None  # None: read over NIXL only
    agent: TransferAgent | None = field(default=None, compare=False)
    mapped: MappedStore | None = field(default=None, compare=False)  # the owner's store, once open() mapped it

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def expected_checksums(self) -> np.ndarray:
        return np.array([checksum_value(b.checksum) for b in self.blocks], dtype=np.int64)

    @property
    def path(self) -> str:
        """How open() chose to read: "shared memory" (page-locked: copied by the device straight from it) or "NIXL"
        ("unopened" before)."""
        if self.mapped is not None:
            return "shared memory" + (" (page-locked)" if self.mapped.page_locked is not None else "")
        return "NIXL" if self.agent is not None else "unopened"

    def select(self, rows: list[int]) -> "PeerBlockReader":
        return PeerBlockReader(self.peer_metadata, [self.blocks[i] for i in rows], self.timeout_s, self.shared_store,
                               self.agent)

    def open(self, buffer: np.ndarray) -> None:
        self.mapped = None
        if self.shared_store is not None:
            # page-locked where this process uses CUDA (its pools there); a CPU process on a GPU node starts no context
            self.mapped = peer_stores.map(self.shared_store, page_locked=torch.cuda.is_initialized())
        if self.mapped is None:
            if self.agent is None:
                self.agent = process_agent()
            self.agent.register(buffer)

    def pinned_rows(self, first: int, count: int) -> torch.Tensor | None:
        blocks = self.blocks[first:first + count]
        if self.mapped is None or self.mapped.page_locked is None or len(block_runs([b.address for b in blocks],
                                                                                    blocks[0].nbytes)) != 1:
            return None
        offset, nbytes = blocks[0].address - self.shared_store.base, blocks[0].nbytes
        return self.mapped.page_locked[offset:offset + count * nbytes].view(count, nbytes)

    def read(self, first: int, dst: np.ndarray) -> None:
        blocks = self.blocks[first:first + dst.shape[0]]
        if self.mapped is not None:
            copy_blocks(self.mapped.array, self.shared_store.base, [b.address for b in blocks], dst)
            return
        assert self.agent is not None, "open() first"
        self.agent.pull(self.peer_metadata, blocks, dst, self.timeout_s, verify=False)

    def __getstate__(self) -> dict[str, object]:
        return {"peer_metadata": self.peer_metadata, "blocks": self.blocks, "timeout_s": self.timeout_s,
                "shared_store": self.shared_store}

    def __setstate__(self, state: dict[str, object]) -> None:
        for name, value in state.items():
            setattr(self, name, value)
        self.agent = self.mapped = None


def coalesce_reads(local_base: int, remote: list[int], nbytes: int) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """NIXL descriptor lists (address, length, device) for reading blocks at `remote` into consecutive
    rows at local_base, one descriptor per run of adjacent remote slots (a stored chain usually is one)."""
    local_descs, remote_descs = [], []
    for start, count in block_runs(remote, nbytes):
        local_descs.append((local_base + start * nbytes, count * nbytes, 0))
        remote_descs.append((remote[start], count * nbytes, 0))
    return local_descs, remote_descs
