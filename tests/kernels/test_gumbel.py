"""Counter-based Gumbel noise (engine/kernels/gumbel.py): kernel vs torch reference bitwise, hash quality.

- Bitwise: Philox against Random123's known answers and Triton's own tl.randint4x; noise and argmax
  kernels against the reference on CPU (TRITON_INTERPRET=1, odd shapes, padding, -inf rows, ties across
  tiles and splits) and on the GPU at the served shape (N = 128, V = 129,280); the bits -> Gumbel
  transform over all 2^32 inputs on the GPU.
- Accuracy: the fp32 transform within 3 fp32 ULPs of max(|g|, 1) of float64 -log(-log1p(-w)) (measured
  max 2.16 on CPU samples).
- Quality: Pearson chi-square at p = 0.001 (fixed keys, so deterministic) of the 32 bits' top and low
  bytes, of pairs of adjacent token ids / steps / seeds (16 x 16 cells), and of the Gumbel CDF of the noise.
"""

import math

import pytest
import torch
import triton
import triton.language as tl

from engine.kernels.gumbel import (gumbel_argmax, gumbel_argmax_ref, gumbel_from_bits, gumbel_from_bits_ref,
                                   gumbel_max, gumbel_max_ref, gumbel_noise, gumbel_noise_ref, philox4x32_10_ref,
                                   philox_bits_ref)

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
SERVED_VOCAB = 129_280
EULER_GAMMA = 0.5772156649015329


def chi2_critical(dof: int, z: float = 3.0902) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.0902: p = 0.001)."""
    a = 2.0 / (9.0 * dof)
    return dof * (1.0 - a + z * math.sqrt(a)) ** 3


def chi2_uniform(cells: torch.Tensor, num_cells: int) -> float:
    counts = torch.bincount(cells.flatten(), minlength=num_cells).double()
    expected = cells.numel() / num_cells
    return float(((counts - expected) ** 2 / expected).sum())


def _keys(pairs: list[tuple[int, int]], device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor([s for s, _ in pairs], dtype=torch.int64, device=device),
            torch.tensor([t for _, t in pairs], dtype=torch.int64, device=device))


AWKWARD_KEYS = [(0, 0), (1, 0), (0, 1), (123, 4), (2**63 - 1, 10_000), (-1, -1), (-(2**63), 2**40 + 3), (7, 2**32)]


# ---------------------------------------------------------------- the hash


@pytest.mark.parametrize("ctr, key, expected", [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
])
def test_philox_reference_known_answers(ctr, key, expected):
    """Random123's kat_vectors for philox4x32_10."""
    out = philox4x32_10_ref(tuple(torch.tensor([c]) for c in ctr), torch.tensor([key[0]]), torch.tensor([key[1]]))
    assert tuple(int(o) for o in out) == expected, [hex(int(o)) for o in out]


@triton.jit
def _randint4x_kernel(out_ptr, seed, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    r0, r1, r2, r3 = tl.randint4x(seed, offs)  # uint32
    tl.store(out_ptr + offs * 4 + 0, r0.to(tl.int64))
    tl.store(out_ptr + offs * 4 + 1, r1.to(tl.int64))
    tl.store(out_ptr + offs * 4 + 2, r2.to(tl.int64))
    tl.store(out_ptr + offs * 4 + 3, r3.to(tl.int64))


@triton.jit
def _bits_to_gumbel_kernel(h_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    h = tl.load(h_ptr + offs, mask=offs < n, other=0).to(tl.uint32)
    tl.store(out_ptr + offs, gumbel_from_bits(h), mask=offs < n)


def bits_to_gumbel(h: torch.Tensor) -> torch.Tensor:
    """The kernel's transform on given uint32 values (int64 tensor) -> fp32."""
    out = torch.empty(h.shape, dtype=torch.float32, device=h.device)
    block = 1024
    _bits_to_gumbel_kernel[(triton.cdiv(h.numel(), block),)](h, out, h.numel(), BLOCK=block, enable_fp_fusion=False)
    return out


def _awkward_bits() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    top = 2**32
    edges = [torch.arange(0, 2048), torch.arange(top - 2048, top)]
    # 1257966796: w ~ 1 - 1/sqrt 2 (log1p's branch); 2714937088: g = 0 (the sign of zero)
    edges += [torch.arange(c - 600, c + 600) for c in (2**23, 2**24, 2**31, 1257966796, 2714937088)]
    return torch.cat([*edges, torch.randint(0, top, (1 << 13,), generator=g)])


def test_bits_to_gumbel_kernel_is_bitwise_reference_and_accurate():
    h = _awkward_bits()
    got, ref = bits_to_gumbel(h), gumbel_from_bits_ref(h)
    diff = (got.view(torch.int32) != ref.view(torch.int32)).nonzero().flatten()
    assert diff.numel() == 0, f"{diff.numel()} differ; first h={int(h[diff[0]])}: {got[diff[0]]} vs {ref[diff[0]]}"
    w = (torch.clamp_max(h.float() + 0.5, 2.0**32 - 256) * 2.0**-32).double()  # the kernel's fp32 w
    exact = -torch.log(-torch.log1p(-w))
    ulp = torch.ldexp(torch.ones_like(exact), torch.frexp(exact.abs().clamp_min(1.0))[1] - 24)
    err = (ref.double() - exact).abs() / ulp
    worst = int(err.argmax())
    assert err.max() <= 3.0, f"h={int(h[worst])}: g={ref[worst].item()} exact={exact[worst].item()} ({err.max():.2f} ULP)"
    assert torch.isfinite(ref).all() and ref.min() > -2.82 and ref.max() < 22.9


def test_philox_matches_tritons_randint4x():
    """Counter (j, 0, 0, 0) and key (seed_lo, seed_hi) is Triton's tl.randint4x(seed, j): same round/key order."""
    seed = 0x0123456789ABCDEF
    out = torch.empty(256 * 4, dtype=torch.int64)
    _randint4x_kernel[(1,)](out, seed, BLOCK=256)
    j = torch.arange(256)
    zero = torch.zeros_like(j)
    ref = philox4x32_10_ref((j, zero, zero, zero), torch.tensor(seed & 0xFFFFFFFF), torch.tensor(seed >> 32))
    assert torch.equal(out.view(256, 4), torch.stack(ref, dim=-1))


# ---------------------------------------------------------------- kernels vs reference (CPU interpreter)


@pytest.mark.parametrize("vocab", [1, 5, 2049, 4099])
def test_noise_kernel_is_bitwise_reference(vocab):
    seeds, steps = _keys(AWKWARD_KEYS)
    got, ref = gumbel_noise(seeds, steps, vocab), gumbel_noise_ref(seeds, steps, vocab)
    assert got.shape == ref.shape == (len(AWKWARD_KEYS), vocab) and got.dtype == torch.float32
    diff = (got.view(torch.int32) != ref.view(torch.int32)).nonzero()
    assert diff.numel() == 0, f"V={vocab}: {diff.size(0)} differ, first [row, v] = {diff[0].tolist()}"


def _logits(num_rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, vocab, generator=g) * 3
    x[0, : vocab // 2] = float("-inf")  # a filtered half
    if num_rows > 2:
        x[1] = float("-inf")
        x[1, vocab - 1] = 0.0  # one survivor, in the last tile
        x[2] = torch.randint(-1, 2, (vocab,), generator=g).float() * 20  # a few huge, tied levels
    return x


@pytest.mark.parametrize("vocab", [7, 2048, 6151])
@pytest.mark.parametrize("num_splits", [None, 1, 2, 5])
def test_argmax_kernel_matches_reference(vocab, num_splits):
    seeds, steps = _keys(AWKWARD_KEYS)
    x = _logits(len(AWKWARD_KEYS), vocab, seed=vocab)
    got = gumbel_argmax(x, seeds, steps, num_splits=num_splits)
    ref = gumbel_argmax_ref(x, seeds, steps)
    assert got.dtype == torch.int64 and got.tolist() == ref.tolist(), f"V={vocab} splits={num_splits}"
    assert got[1] == vocab - 1
    assert torch.equal(got, (x + gumbel_noise(seeds, steps, vocab)).argmax(dim=-1))


def test_argmax_ties_go_to_lower_id_across_tiles_and_splits():
    vocab = 9000
    seeds, steps = _keys([(5, 1), (6, 2), (7, 3), (8, 4)])
    g = gumbel_noise(seeds, steps, vocab)
    x = torch.full((4, vocab), float("-inf"))
    x[0] = -g[0]  # x + g == 0 exactly everywhere: the first id wins
    x[1, [3000, 4500, 8999]] = -g[1, [3000, 4500, 8999]]  # tie across tiles (and splits)
    x[2, [8191, 8192]] = -g[2, [8191, 8192]]
    # row 3 stays all -inf: argmax's answer, 0
    for splits in (1, 2, 3, None):
        assert gumbel_argmax(x, seeds, steps, num_splits=splits).tolist() == [0, 3000, 8191, 0], splits
    assert gumbel_argmax_ref(x, seeds, steps).tolist() == [0, 3000, 8191, 0]


def test_argmax_batch_independent_and_strided_rows():
    vocab = 3001
    seeds, steps = _keys(AWKWARD_KEYS)
    wide = _logits(len(AWKWARD_KEYS), vocab + 77, seed=1)
    x = wide[:, :vocab]  # row stride > V
    batch = gumbel_argmax(x, seeds, steps)
    alone = [int(gumbel_argmax(x[i : i + 1].contiguous(), seeds[i : i + 1], steps[i : i + 1])) for i in range(len(seeds))]
    assert batch.tolist() == alone
    perm = torch.tensor([5, 2, 7, 0, 1, 6, 3, 4])
    assert gumbel_argmax(x[perm], seeds[perm], steps[perm]).tolist() == batch[perm].tolist()


def test_empty_and_contract():
    seeds, steps = _keys([])
    assert gumbel_argmax(torch.zeros(0, 10), seeds, steps).shape == (0,)
    assert gumbel_noise(seeds, steps, 10).shape == (0, 10)
    seeds, steps = _keys([(1, 2)])
    with pytest.raises(AssertionError, match="fp32"):
        gumbel_argmax(torch.zeros(1, 10, dtype=torch.float64), seeds, steps)
    with pytest.raises(AssertionError, match="int64"):
        gumbel_argmax(torch.zeros(1, 10), seeds.int(), steps)
    with pytest.raises(AssertionError, match="entries for 2 rows"):
        gumbel_argmax(torch.zeros(2, 10), seeds, steps)
    with pytest.raises(AssertionError, match="unit stride"):
        gumbel_argmax(torch.zeros(10, 2).t(), *_keys([(1, 2), (3, 4)]))


# ---------------------------------------------------------------- hash and noise quality (reference)


def _bits(pairs: list[tuple[int, int]], vocab: int) -> torch.Tensor:
    return philox_bits_ref(*_keys(pairs), vocab)  # [R, V] uint32 values in int64


def test_bits_are_uniform():
    h = _bits([(s, t) for s in range(64) for t in range(4)], 4096)  # 1M draws
    for name, cells in (("top byte", h >> 24), ("low byte", h & 255), ("bits 12-19", (h >> 12) & 255)):
        chi2 = chi2_uniform(cells, 256)
        assert chi2 < chi2_critical(255), f"{name}: chi2 {chi2:.1f} >= {chi2_critical(255):.1f}"


@pytest.mark.parametrize("neighbour", ["token id", "step", "seed"])
def test_adjacent_draws_are_independent(neighbour):
    """Joint distribution of the top nibbles of two draws one apart in token id, step or seed: uniform over
    16 x 16 cells (independent and uniform)."""
    if neighbour == "token id":
        h = _bits([(s, 0) for s in range(128)], 8192)
        a, b = h[:, :-1], h[:, 1:]
    elif neighbour == "step":
        h = _bits([(3, t) for t in range(129)], 8192)
        a, b = h[:-1], h[1:]
    else:
        h = _bits([(s, 5) for s in range(129)], 8192)
        a, b = h[:-1], h[1:]
    cells = (a >> 28) * 16 + (b >> 28)
    chi2 = chi2_uniform(cells, 256)
    assert chi2 < chi2_critical(255), f"{neighbour}: chi2 {chi2:.1f} >= {chi2_critical(255):.1f}"
    r = torch.corrcoef(torch.stack([a.flatten().double(), b.flatten().double()]))[0, 1].item()
    assert abs(r) < 4 / math.sqrt(a.numel()), f"{neighbour}: correlation {r:.2e}"


def test_noise_is_standard_gumbel():
    g = gumbel_noise_ref(*_keys([(s, 7) for s in range(32)]), 32768).double().flatten()  # 1M draws
    cdf = torch.exp(-torch.exp(-g))  # uniform if g ~ Gumbel(0, 1)
    chi2 = chi2_uniform((cdf * 100).long().clamp_max(99), 100)
    assert chi2 < chi2_critical(99), f"Gumbel CDF chi2 {chi2:.1f} >= {chi2_critical(99):.1f}"
    n = g.numel()
    assert abs(g.mean().item() - EULER_GAMMA) < 4 * math.pi / math.sqrt(6 * n), g.mean().item()
    assert abs(g.var().item() - math.pi**2 / 6) < 0.01, g.var().item()
    # the upper tail that decides argmax over a large vocabulary: P(g > 8) = 1 - exp(-e^-8)
    p_tail = 1 - math.exp(-math.exp(-8.0))
    tail = (g > 8.0).sum().item()
    assert abs(tail - n * p_tail) < 4 * math.sqrt(n * p_tail), (tail, n * p_tail)


# ---------------------------------------------------------------- GPU


@gpu
@needs_cuda
def test_gpu_noise_and_argmax_match_cpu_reference_at_served_shape():
    num_rows = 128
    pairs = [(1000 + 7919 * i, i * 13) for i in range(num_rows - len(AWKWARD_KEYS))] + AWKWARD_KEYS
    seeds, steps = _keys(pairs)
    noise_cpu = gumbel_noise_ref(seeds, steps, SERVED_VOCAB)
    noise_gpu = gumbel_noise(seeds.cuda(), steps.cuda(), SERVED_VOCAB).cpu()
    diff = (noise_gpu.view(torch.int32) != noise_cpu.view(torch.int32)).nonzero()
    assert diff.numel() == 0, f"{diff.size(0)} noise values differ, first [row, v] = {diff[0].tolist()}"
    g = torch.Generator().manual_seed(0)
    x = torch.randn(num_rows, SERVED_VOCAB, generator=g) * 4
    x[::3, 50_000:] = float("-inf")
    x[1::5] /= 50  # nearly flat rows: the noise decides
    tokens_cpu = gumbel_argmax_ref(x, seeds, steps)
    for splits in (None, 1, 7):
        tokens_gpu = gumbel_argmax(x.cuda(), seeds.cuda(), steps.cuda(), num_splits=splits).cpu()
        assert tokens_gpu.tolist() == tokens_cpu.tolist(), f"splits={splits}"
    assert torch.equal(gumbel_argmax_ref(x.cuda(), seeds.cuda(), steps.cuda()).cpu(), tokens_cpu)
    width = SERVED_VOCAB // 8  # rank 3 of 8's slice of a vocab-parallel head (engine/core/sharded_draw.py)
    part = x[:, 3 * width:4 * width].contiguous()
    val_cpu, at_cpu = gumbel_max_ref(part, seeds, steps, 3 * width)
    val_gpu, at_gpu = gumbel_max(part.cuda(), seeds.cuda(), steps.cuda(), 3 * width)
    assert at_gpu.cpu().tolist() == at_cpu.tolist() and torch.equal(val_gpu.cpu(), val_cpu)


@gpu
@needs_cuda
def test_gpu_transform_is_bitwise_reference_on_all_32bit_inputs():
    chunk = 1 << 28
    worst = 0.0
    for start in range(0, 1 << 32, chunk):
        h = torch.arange(start, start + chunk, dtype=torch.int64, device="cuda")
        got, ref = bits_to_gumbel(h), gumbel_from_bits_ref(h)  # torch ops on the GPU: one IEEE op each
        bad = (got.view(torch.int32) != ref.view(torch.int32)).nonzero()
        assert bad.numel() == 0, f"{bad.numel()} differ from h={start}; first h={start + int(bad[0])}"
        w = (torch.clamp_max(h.float() + 0.5, 2.0**32 - 256) * 2.0**-32).double()
        exact = -torch.log(-torch.log1p(-w))
        ulp = torch.ldexp(torch.ones_like(exact), torch.frexp(exact.abs().clamp_min(1.0))[1] - 24)
        worst = max(worst, ((got.double() - exact).abs() / ulp).max().item())
        del h, got, ref, w, exact, ulp
    assert worst <= 3.0, f"max error {worst:.2f} ULP"
    h = _awkward_bits()
    assert torch.equal(bits_to_gumbel(h.cuda()).cpu().view(torch.int32), gumbel_from_bits_ref(h).view(torch.int32))
