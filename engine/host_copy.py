"""Host-built tensors (a step's metadata, token ids) onto the device without the host waiting for the device.

`t.to("cuda")` from ordinary (pageable) host memory is a blocking copy: torch synchronises the stream after it, so
the host waits until every kernel queued before it has run, and the GPU then idles while the host builds and
launches what follows. An eager prefill step built ~20 such tensors (issue 23: 2,960 pageable copies and 2,962
stream syncs while a 32K prompt prefilled beside decodes, H100). Here the tensor goes through page-locked memory
from torch's caching host allocator, which keeps that block until the copy has run (it records an event on the
copy's stream), and the copy is queued on the current stream: the host goes on at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def to_device(t: Tensor, device: torch.device | str, dtype: torch.dtype | None = None) -> Tensor:
    """t (any device) on `device` as `dtype` (default: t's). A CPU tensor bound for a CUDA device is copied
    through page-locked memory on the current stream, without a host wait; anything else is `t.to`. Not for use
    inside a CUDA-graph capture (a host copy is not capturable either way)."""
    device = torch.device(device)
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def tensor_on(values: Sequence, device: torch.device | str, dtype: torch.dtype) -> Tensor:
    """torch.tensor(values, dtype) on `device`, through to_device."""
    return to_device(torch.tensor(values, dtype=dtype), device)
