"""token_mask (engine/kernels/token_mask.py) against the host sampler's decoding of the same llguidance bitmask
bytes (sampler.allowed_tokens, an independent unpacking): disallowed tokens become -inf, allowed ones keep their
value bit for bit (NaN and +inf included); odd vocab sizes, a vocab slice starting at a non-zero id (a rank's),
rows with every bit set and rows with none."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.core.sampler import allowed_tokens
from engine.kernels.token_mask import BLOCK, token_mask, token_mask_ref

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def masks(full_vocab: int, rows: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    num_bytes = (full_vocab + 31) // 32 * 4 + 4  # llguidance may write one word more
    out = [rng.integers(0, 256, num_bytes, dtype=np.uint8).tobytes() for _ in range(rows - 2)]
    return out + [b"\xff" * num_bytes, b"\x00" * num_bytes]


def case(full_vocab: int, first: int, width: int, device: str):
    m = masks(full_vocab, 5, seed=full_vocab + first)
    words = torch.from_numpy(np.frombuffer(b"".join(m), dtype="<i4").reshape(len(m), -1).copy()).to(device)
    x = torch.randn(len(m), width, generator=torch.Generator().manual_seed(first)) * 4
    x[0, 3], x[1, width - 1], x[2, 0] = float("nan"), float("inf"), float("-inf")
    allowed = allowed_tokens(m, full_vocab, torch.device("cpu"))[:, first:first + width]
    want = torch.where(allowed, x, float("-inf"))
    return x.to(device), words, want


def check(got: torch.Tensor, want: torch.Tensor, params: str) -> None:
    got = got.cpu()
    same = (got == want) | (got.isnan() & want.isnan())
    assert bool(same.all()), f"{params}: {int((~same).sum())} tokens differ, first at {(~same).nonzero()[0].tolist()}"


@pytest.mark.parametrize("full_vocab,first,width", [(1000, 0, 1000), (BLOCK + 37, 0, BLOCK + 37), (1000, 96, 500),
                                                    (1000, 40, 333)])
def test_token_mask_keeps_exactly_the_allowed_tokens(full_vocab, first, width):
    x, words, want = case(full_vocab, first, width, "cpu")
    check(token_mask_ref(x, words, first), want, f"ref V={full_vocab} first={first}")
    token_mask(x, words, first)
    check(x, want, f"kernel V={full_vocab} first={first}")


def test_too_few_words_is_refused():
    x, words, _ = case(1000, 0, 1000, "cpu")
    with pytest.raises(AssertionError, match="mask words"):
        token_mask(x, words[:, :10])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("full_vocab,first,width", [(129280, 0, 129280), (129280, 16160 * 3, 16160)])
def test_token_mask_gpu(full_vocab, first, width):
    x, words, want = case(full_vocab, first, width, "cuda")
    token_mask(x, words, first)
    check(x, want, f"cuda V={full_vocab} first={first}")
