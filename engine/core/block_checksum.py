"""The 64-bit checksum of a KV block's flat record (engine/core/kv_blocks.py), computed alike on the host and on
the GPU, so a pull verifies the bytes where they landed: in the importer's device memory, not in a host pass.

    checksum(record) = sum_i w_i * x_i  mod 2^64

x_i: the record's little-endian int32 words (sign-extended to int64); w_i: fixed odd 64-bit weights from a seeded
generator (the same on every process and device). A single changed word always changes the sum (w_i is odd, so
w_i * d is not 0 mod 2^64 for any word difference 0 < |d| < 2^33); a torn or reused slot, i.e. many changed words,
collides with probability about 2^-64 for data not built to collide. It guards against torn reads and reused
slots, not adversaries: the chain hash names the content. On a GPU it is one Triton kernel
(engine/kernels/weighted_sums.py: the words read once); on the host, numpy's integer matrix-vector product (~3 GB/s
on one core of the 2-core CI machine). zlib's CRC-32, which it replaces, ran at 4-7 GB/s on the H200 machine's host
with any number of threads and was the slowest part of a pull.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from engine.kernels.weighted_sums import weighted_row_sums

SEED = 0x0D5F41_4B56  # "dsv41" "KV": changing it (or the weights' generation) makes every published record stale
SLICE_WORDS = 1 << 20  # host rows are summed in slices of about this many words (int64 temporaries of 8 MiB)

_weights: dict[tuple[int, torch.device], torch.Tensor] = {}
_weights_lock = threading.Lock()


def block_weights(num_words: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """int64 [num_words], odd: w_i for a record of num_words int32 words (cached per size and device)."""
    device = torch.device(device)
    key = (num_words, device)
    with _weights_lock:
        w = _weights.get(key)
        if w is None:
            g = torch.Generator().manual_seed(SEED)
            w = torch.randint(-2**62, 2**62, (num_words,), dtype=torch.int64, generator=g) * 2 + 1
            _weights[key] = w = w.to(device)
        return w


@torch.inference_mode()
def block_checksums(rows: torch.Tensor) -> torch.Tensor:
    """rows: uint8 [n, block_bytes] (block_bytes a multiple of 4, rows C-contiguous), on any device. Returns
    int64 [n] on rows' device: each row's checksum (mod 2^64, as a signed int64). Queued on the current stream
    on CUDA (no sync)."""
    assert rows.dtype == torch.uint8 and rows.dim() == 2 and rows.shape[1] % 4 == 0 and rows.is_contiguous(), \
        f"rows {rows.dtype} {tuple(rows.shape)}: uint8 [n, 4k], C-contiguous"
    if rows.device.type == "cpu":
        return torch.from_numpy(host_block_checksums(rows.numpy()))
    words = rows.view(torch.int32)  # [n, num_words]
    return weighted_row_sums(words, block_weights(words.shape[1], rows.device))


def host_block_checksums(records: np.ndarray) -> np.ndarray:
    """block_checksums of host rows (uint8 [n, block_bytes], a multiple of 4, C-contiguous; read-only is fine):
    int64 [n], by numpy's int64 matrix-vector product (no [n, num_words] product temporary)."""
    assert records.dtype == np.uint8 and records.ndim == 2 and records.shape[1] % 4 == 0 \
        and records.flags.c_contiguous, f"records {records.dtype} {records.shape}: uint8 [n, 4k], C-contiguous"
    n, num_words = records.shape[0], records.shape[1] // 4
    words, w = records.view(np.int32), block_weights(num_words).numpy()
    step = max(1, SLICE_WORDS // max(1, num_words))
    out = np.empty(n, dtype=np.int64)
    for first in range(0, n, step):
        out[first:first + step] = words[first:first + step].astype(np.int64) @ w
    return out


def checksum_bytes(value: int) -> bytes:
    """A checksum (a signed int64, as block_checksums gives) as the 8 bytes records carry, big-endian unsigned."""
    return (value & (2**64 - 1)).to_bytes(8, "big")


def checksum_value(data: bytes) -> int:
    """The inverse of checksum_bytes: the signed int64 block_checksums gives."""
    assert len(data) == 8, f"a block checksum has 8 bytes, got {len(data)}"
    return int.from_bytes(data, "big", signed=True)
