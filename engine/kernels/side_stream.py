"""Work forked onto a side stream of the current stream and joined back into it (also inside a CUDA-graph capture:
the fork and the join become the graph's edges).

    forked = fork("name", device, fn)   # the side stream waits for the current stream's work so far, then runs fn()
    out = forked.join()                 # the current stream waits for the side stream; fn's tensors are marked as
                                        # used by it (their memory is not reused before that)

One side stream per (name, device), created on first use: a capture must be warmed up first (the engine and
benchmarks/gpu_timing.py run a step before capturing it), since a stream cannot be created while capturing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

import torch
from torch import Tensor

T = TypeVar("T", Tensor, tuple[Tensor, ...])

_STREAMS: dict[tuple[str, torch.device], torch.cuda.Stream] = {}


def side_stream(name: str, device: torch.device) -> torch.cuda.Stream:
    """The side stream `name` of `device` (created on first use)."""
    key = (name, torch.device(device))
    stream = _STREAMS.get(key)
    if stream is None:
        stream = _STREAMS[key] = torch.cuda.Stream(key[1])
    return stream


class Forked(Generic[T]):
    """The result of fork: join() hands fn's output to the stream that forked it."""

    def __init__(self, current: torch.cuda.Stream, side: torch.cuda.Stream, out: T):
        self._current, self._side, self._out = current, side, out

    def join(self) -> T:
        self._current.wait_stream(self._side)
        for t in (self._out if isinstance(self._out, tuple) else (self._out,)):
            t.record_stream(self._current)
        return self._out


def fork(name: str, device: torch.device, fn: Callable[[], T]) -> Forked[T]:
    """Run fn() on the side stream `name`, after the current stream's work so far; join() the result before use."""
    current, side = torch.cuda.current_stream(device), side_stream(name, device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        out = fn()
    return Forked(current, side, out)
