"""Launch shapes of the CUDA decode GEMVs (`cuda/fp8_gemv.cu`, `cuda/bf16_gemv.cu`): the parameter record both
launchers take and the bytes-per-wave model that picks one where no swept shape is recorded.

A warp owns row_tiles x 16 weight rows; a CTA has warps_n x warps_k warps (warps_k split the CTA's K range);
a thread-block cluster of `splits` CTAs splits K further; `unroll` 32-column blocks are in flight per thread.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

BLOCK = 32  # K columns per block (one scale block; two m16n8k16 MMAs)
MAX_WARPS = 8  # per CTA
MAX_SPLITS = 8  # portable cluster size
SMEM_PER_SM = 228 * 1024


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class GemvParams:
    """Launch shape of a decode GEMV. splits is rounded down by `normalised` to the number of CTAs that own K
    columns."""

    row_tiles: int  # 1 or 2: rows per warp / 16
    unroll: int  # 2, 4 or 8: 32-column blocks in flight per thread
    warps_n: int
    warps_k: int
    splits: int  # cluster size, 1..8
    pdl: bool = True  # programmatic dependent launch: weight loads overlap the previous kernel's tail
    ring: int = 0  # the FP8 GEMV only: 0 = weights loaded into registers (unroll blocks a step); 2..4 = weights
    #                staged through a per-warp shared-memory ring of that many stages of 4 blocks (unroll unused)

    def normalised(self, k: int) -> GemvParams:
        kb = k // BLOCK
        kbc = cdiv(kb, min(self.splits, kb))
        return replace(self, splits=cdiv(kb, kbc))

    @property
    def rows_per_cta(self) -> int:
        return self.warps_n * self.row_tiles * 16


def model_shape(m: int, n: int, k: int, *, weight_bytes: int, smem_bytes: Callable[[int, GemvParams], int],
                max_smem: int, overhead_bytes: int, num_sms: int = 132, groups: int = 1) -> GemvParams:
    """The bytes-per-wave model: 8 warps of 32 rows, K split over warps and a cluster so that one wave of CTAs
    (2 per SM when shared memory allows) covers the `groups` matrices of [n, k] with the fewest bytes per CTA:
    weight_bytes x (its weight elements + its read of x from L2, one element per token and column) plus a fixed
    start-up cost in bytes; ties go to fewer cluster splits, then fewer warp splits."""
    kb = k // BLOCK
    best: tuple[float, int, int, GemvParams] | None = None
    for warps_k in (1, 2, 4, 8):
        for splits in range(1, MAX_SPLITS + 1):
            p = GemvParams(2, 4, MAX_WARPS // warps_k, warps_k, splits)
            if p.normalised(k).splits != splits or (warps_k > 1 and cdiv(kb, splits) < 2 * warps_k):
                continue
            smem = smem_bytes(k, p)
            if smem > max_smem:
                continue
            resident = max(1, min(2, SMEM_PER_SM // (smem + 1024)))
            ctas = cdiv(n, p.rows_per_cta) * splits * groups
            waves = cdiv(ctas, resident * num_sms)
            kc = cdiv(kb, splits) * BLOCK
            cost = waves * (weight_bytes * (p.rows_per_cta * kc + m * kc) + overhead_bytes)
            key = (cost, splits, warps_k, p)
            if best is None or key[:3] < best[:3]:
                best = key
    assert best is not None, f"no launch shape for K = {k}"
    return best[3]
