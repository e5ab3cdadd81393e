"""decode_meta and decode_inputs (engine/kernels/decode_meta.py) against their torch references, bitwise (indices
and hash ids: no tolerance). Random rows at odd batch sizes: positions from 0 (no look-back) to past the window,
rings and block tables with holes (-1), floors above and below the window, rows that write no global KV
(global_from past pos), ratio-2 rows at both parities; windows smaller than, equal to and larger than a block; models
with ratios (0, 1, 2), (0, 2) and (0,). The Engram hashes at the real config's primes and multipliers, with DEAD
and pad look-back, and ids read from the previous draw (from_row)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.engram_tables import DEAD, EngramTables
from engine.kernels.decode_meta import decode_inputs, decode_inputs_torch, decode_meta, decode_meta_torch

GLOBAL_BLOCK = 64
ON_GPU = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                          reason="needs a CUDA GPU")])
DEVICES = ["cpu", ON_GPU]


def rows(B: int, C: int, window: int, swa_block: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    R = (window - 1) // swa_block + 2
    pos = torch.randint(0, C, (B,), generator=g)
    pos[0] = 0
    nb = C // GLOBAL_BLOCK
    gtable = torch.randint(0, 500, (B, nb), generator=g)
    gtable[torch.rand(B, nb, generator=g) < 0.2] = -1
    ring = torch.randint(0, 300, (R, B), generator=g).t()  # the decode step's ring is a transposed view
    ring[torch.rand(B, R, generator=g) < 0.2] = -1
    return dict(pos=pos, swa_floor=pos - torch.randint(-3, 2 * window, (B,), generator=g),
                dec_floor=pos - torch.randint(-3, window + 5, (B,), generator=g),
                global_from=pos + torch.randint(-40, 3, (B,), generator=g),
                pending=torch.randint(0, 30, (B,), generator=g), ring=ring, gtable=gtable)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("B,C,window,swa_block,ratios", [
    (1, 256, 16, 16, (0, 1, 2)), (5, 256, 16, 16, (0, 1, 2)), (3, 512, 128, 16, (0, 2, 1)),
    (7, 1024, 24, 16, (0, 2)), (2, 2048, 8, 16, (0,)), (9, 256, 128, 64, (0, 1))])
def test_decode_meta_equals_the_torch_steps(B, C, window, swa_block, ratios, device):
    for seed in range(3):
        r = {k: v.to(device) for k, v in rows(B, C, window, swa_block, seed).items()}
        args = (*r.values(), window, swa_block, GLOBAL_BLOCK, ratios)
        got, ref = decode_meta(*args), decode_meta_torch(*args)
        what = f"B={B} C={C} W={window} S={swa_block} ratios={ratios} seed={seed}"
        assert torch.equal(got.write, ref.write), f"{what}: write {got.write} != {ref.write}"
        assert got.swa.dtype == ref.swa.dtype == torch.int32 and torch.equal(got.swa, ref.swa), f"{what}: swa"
        assert ref.swa.eq(-1).any() and ref.swa.ge(0).any(), f"{what}: the case should have held and missing slots"
        assert got.entries.keys() == ref.entries.keys() == {1, 2} & set(ratios)
        for k in ref.entries:
            for name in ("entries", "visible", "slots", "gpos"):
                a, b = getattr(got, name)[k], getattr(ref, name)[k]
                assert a.dtype == b.dtype and torch.equal(a, b), f"{what}: ratio {k} {name}\n{a}\n{b}"
        assert (got.items is None) == (ref.items is None) == (2 not in ratios)
        if ref.items is not None:
            assert torch.equal(got.items, ref.items), f"{what}: items\n{got.items}\n{ref.items}"


def test_the_window_of_a_hand_built_row():
    """One row by hand: W = 16, S = 16, pos 37 -> the window is 22 .. 37, blocks 1 and 2 of the request, held in
    window blocks 7 and 4 (the ring's first block is lo = 22 // 16 = 1); floor 30 hides positions 22 .. 29."""
    pos, W, S = 37, 16, 16
    one = lambda v: torch.tensor([v])  # noqa: E731
    ring = torch.tensor([[7, 4]])
    gtable = torch.tensor([[11, -1, 3, 5]])  # C = 256
    meta = decode_meta(one(pos), one(30), one(0), one(0), one(9), ring, gtable, W, S, GLOBAL_BLOCK, (0, 1, 2))
    expect = [-1] * 8 + [7 * 16 + p % 16 for p in range(30, 32)] + [4 * 16 + p % 16 for p in range(32, 38)]
    assert meta.swa[0, 0].tolist() == expect
    assert meta.swa[1, 0].tolist() == [7 * 16 + p % 16 for p in range(22, 32)] + expect[10:]
    assert meta.write.tolist() == [4 * 16 + 37 % 16]
    assert meta.slots[1].tolist() == [11 * 64 + 37] and meta.visible[1].tolist() == [38]
    # ratio 2: pos 37 is the second token of group 18, which completes now (entry 18 of block 11's 32)
    assert meta.slots[2].tolist() == [11 * 32 + 18] and meta.gpos[2].tolist() == [36]
    assert meta.items.tolist() == [[-10, 0, 0, 36, -1, -1]]
    assert meta.entries[1][0, 64:128].eq(0).all() and meta.entries[1][0, 130].item() == 3 * 64 + 2


@pytest.fixture(scope="module")
def tables() -> EngramTables:
    """Engram tables at the released config's primes and multipliers (layers 1 and 14, 4-grams, 8 heads) over a
    random token map of 2,000 ids."""
    g = torch.Generator().manual_seed(0)
    token_map = torch.randint(0, 1500, (2000,), generator=g)
    return EngramTables.build(token_map, 1500, (1, 14), 4, 8, 16000000, 2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("B", [1, 6, 33])
def test_decode_inputs_equal_hash_ngrams(tables, B, device):
    g = torch.Generator().manual_seed(B)
    lookback = 4
    for dead in (False, True):
        t = tables
        if dead:  # a compressed id DEAD (an image token's) blocks its n-grams and every longer one
            t = dataclasses.replace(tables, token_map=torch.where(tables.token_map % 7 == 0, DEAD, tables.token_map))
        t = t.to(device)
        ids = torch.randint(0, 2000, (B,), generator=g)
        last = torch.randint(0, 2000, (64,), generator=g)
        from_row = torch.where(torch.rand(B, generator=g) < 0.5, torch.randint(0, 64, (B,), generator=g), -1)
        pos = torch.randint(0, 6, (B,), generator=g)  # 0 .. 5: look-back blocked at position 0, 1, 2 and not
        prev = torch.randint(0, 2000, (lookback, B), generator=g).t()
        prev[torch.arange(lookback)[None, :] < lookback - pos[:, None]] = -1  # nothing before position 0
        ids, last, from_row, pos, prev = (x.to(device) for x in (ids, last, from_row, pos, prev))
        got_ids, got = decode_inputs(ids, from_row, last, pos, prev, t)
        ref_ids, ref = decode_inputs_torch(ids, from_row, last, pos, prev, t)
        assert torch.equal(got_ids, ref_ids) and torch.equal(got, ref), f"B={B} dead={dead}\n{got}\n{ref}"
        assert got.shape == (B, 2, 3 * 8) and bool((got >= 0).all())
    ids_only, none = decode_inputs(ids, from_row, last, pos, prev, None)
    assert none is None and torch.equal(ids_only, ref_ids)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_inputs_block_at_image_positions(tables, device):
    """A -1 in the look-back past position 0 is an image-span position (DEAD, decode_step.lookback_ids): it blocks
    its n-grams and every longer one, whatever lies before it. Rows whose token just before is one (then text, or
    more image) hash as at position 0 (nothing to look back at); the torch reference agrees bitwise."""
    g = torch.Generator().manual_seed(7)
    B, lookback = 9, 4
    ids = torch.randint(0, 2000, (B,), generator=g)
    pos = torch.full((B,), 10)
    prev = torch.randint(0, 2000, (B, lookback), generator=g)
    dead_from = torch.arange(B) % 4  # row b: shifts >= 1 + b % 4 are image positions (Engram reaches 3 back)
    shift = lookback - torch.arange(lookback)  # of each column (oldest first)
    prev[shift[None, :] >= 1 + dead_from[:, None]] = -1
    prev[::8, :-1] = torch.randint(0, 2000, (prev[::8].size(0), lookback - 1), generator=g)  # text before the dead one
    none = torch.full((B,), -1)
    ids, pos, prev, none, t = (x.to(device) for x in (ids, pos, prev, none, tables))
    _, got = decode_inputs(ids, none, ids, pos, prev, t)
    _, ref = decode_inputs_torch(ids, none, ids, pos, prev, t)
    assert torch.equal(got, ref)
    _, at_zero = decode_inputs(ids, none, ids, torch.zeros_like(pos), prev, t)
    first = (dead_from == 0).to(device)
    assert torch.equal(got[first], at_zero[first])
    assert not (got[~first] == at_zero[~first]).all(dim=-1).all(dim=-1).any(), "a row with text before it hashed as at 0"
