"""BlockReaders whose reads wait for the test's go-ahead, to hold a KV pull in flight: GatedReader in this process
(a threading.Event), FileGatedReader across processes (a shard actor: a file that appears). A module of its own
so that Ray pickles them by reference to a module its workers can import (tests.kv.gated_reader)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np

TIMEOUT_S = 60  # a held pull, or a stream that gets no tokens meanwhile, fails its test instead of hanging it


class GatedReader:
    """A BlockReader over host records whose reads wait until `go` is set (the test's hand on the pull); it may
    fail at one block. `selected` logs the rows each pull asked for; `started` is set at the first read."""

    def __init__(self, data: np.ndarray, go: threading.Event | None = None, fail_at: int | None = None,
                 selected: list | None = None, started: threading.Event | None = None):
        self.data, self.go, self.fail_at = data, go or threading.Event(), fail_at
        self.selected = [] if selected is None else selected
        self.started = started or threading.Event()

    expected_checksums = None  # test data, trusted as it is

    def pinned_rows(self, first: int, count: int) -> None:
        return None

    @property
    def num_blocks(self) -> int:
        return self.data.shape[0]

    def select(self, rows: list[int]) -> "GatedReader":
        self.selected.append(list(rows))
        return GatedReader(self.data[rows], self.go, self.fail_at, self.selected, self.started)

    def open(self, buffer: np.ndarray) -> None:
        pass

    def read(self, first: int, dst: np.ndarray) -> None:
        self.started.set()
        assert self.go.wait(TIMEOUT_S), "the test never let the read go"
        if first == self.fail_at:
            raise ConnectionError(f"block {first}: the owner went away")
        dst[:] = self.data[first:first + dst.shape[0]]


class FileGatedReader:
    """Blocks in host memory whose first read creates `started` and then waits until `go` exists."""

    def __init__(self, data: np.ndarray, started: str, go: str):
        self.data, self.started, self.go = data, started, go

    expected_checksums = None  # test data, trusted as it is

    def pinned_rows(self, first: int, count: int) -> None:
        return None

    @property
    def num_blocks(self) -> int:
        return self.data.shape[0]

    def select(self, rows: list[int]) -> "FileGatedReader":
        return FileGatedReader(self.data[rows], self.started, self.go)

    def open(self, buffer: np.ndarray) -> None:
        pass

    def read(self, first: int, dst: np.ndarray) -> None:
        Path(self.started).touch()
        deadline = time.monotonic() + TIMEOUT_S
        while not Path(self.go).exists():
            assert time.monotonic() < deadline, "the test never let the read go"
            time.sleep(0.01)
        dst[:] = self.data[first:first + dst.shape[0]]
