// Lightning-indexer scan at decode (engine/kernels/indexer_cuda.py): scores of M <= 8 queries (H heads each,
// D = 128) against T packed MXFP4 index-key records gathered by slot, engine.kernels.indexer.index_scores's
// contract and rounding path:
//
//   s_h = bf16(q[m, h] · k_t),  p_h = bf16(relu(s_h) · w[m, h]),  score = bf16(Σ_h p_h),  -inf past visible[m]
//
// Record (68 B): 64 bytes of E2M1 pairs (element 2i in the low nibble of byte i), then one UE8M0 scale byte per 32.
//
// Products (why the dot is the golden's float64 dot wherever an fp32 sum is exact):
// - keys: a nibble becomes the f16 whose bits are the nibble moved into place (e2m1_pair: value · 2^-14, exact);
// - queries: each row of q is staged in f16 as q / sa with sa = 2^max(floor(log2 amax) - 15, -126), amax the
//   row's max |q| (sa = 1 for an all-zero row): fp8_gemv's bf16-exact staging (its header has the proof), per
//   row: every |q| >= amax·2^-32 is exact (all of an MXFP4 row unless its block scales span > 2^30); smaller ones
//   are rounded on the 2^-24·sa grid;
// - mma.sync m16n8k16 (f16 x f16 -> fp32) over the 32 products of one block (two MMAs), a fresh accumulator per
//   block: each product has <= 11 + 2 significant bits (exact); for MXFP4 q every staged value of a block is an
//   E2M1 value times one power of two, so the products are multiples of one quantum (0.5 · 0.5 in code units)
//   and the block sum is at most 32 · 6 · 6 = 1152 = 4608 quanta: 13 bits, exact in fp32 in any order;
// - acc = Σ_b cc_b · sk_b in block order with fmaf (cc_b · sk_b is exact, sk a power of two: one rounding per
//   block, none while the running sum is exact in fp32); acc = dot / sq with sq = sa · 2^14 a power of two;
// - epilogue, by scale invariance of round-to-nearest under powers of two (away from fp32/bf16 under- and
//   overflow): bf16(dot) = bf16(acc) · sq and bf16(relu(bf16(dot)) · w) = bf16(relu(bf16(acc)) · w'), with
//   w' = w · sq staged once per CTA (a bf16 times a power of two: exact); relu and the product on bf16x2 pairs
//   (mul.bf16x2: bf16 x bf16 is exact in fp32, rounded once), the H head terms summed in fp32 (per thread over
//   its rows in row order, then a butterfly over the 8 row groups: commutative adds, every lane gets the same
//   value: deterministic) and rounded to bf16.
// So the score is bitwise the golden's (float64 dot, float64 head sum) whenever the 4-term block accumulation
// and the H-term head sum are exact in fp32 — the Triton kernel's condition too (its fp32 dot accumulates the
// 128 products directly); both are exact unless the terms span more than ~11 (dot) / ~16 (heads) binary orders.
// (UE8M0 code 0 decodes to 0 as in the Triton kernel, to 2^-127 in the golden: they differ only for a block whose
// values are all below ~2^-125, i.e. in practice an all-zero block, where both give 0.)
//
// Data path: the M·H query rows (<= 256) are staged once per CTA in shared memory as f16 A fragments (q_frag_word):
// each 8-element slice in the order 0 4 1 5 2 6 3 7 (moe_fp4's perm8), laid out so that lane (g, t) loads each
// MMA's four A registers with one conflict-free 16-byte load. Each warp owns units of NB groups of 8 entries (the
// MMA's N: entry g of a group is column g), units dealt round-robin over all warps of the persistent grid; per
// unit it copies, with 4-byte cp.async (a record is only 4-byte aligned), word 4b + t of block b of entry g into
// lane (g, t)'s own ring slot and the scale word of entry g (lanes t = 0), STAGES - 1 units ahead; the slots of
// the next two units are prefetched into registers. Thread (g, t) turns its word of block b into the 4 B
// registers of that block's 2 MMAs: pairs (elements 8t + j, 8t + j + 4), j = 0..3 — the same k permutation as
// the staged queries. C fragment: rows g, g + 8 x entries 2t, 2t + 1. The head sums of a unit's 2·NB entries per
// lane are reduced over g by a reduce-scatter (reduce_scatter_g), each lane storing one score.
// No global workspace, no atomics: any stream, CUDA-graph capturable.
// Programmatic dependent launch: q, w, slots, visible and the key pool may all be the predecessor's output (the
// new entry's record), so the kernel waits for its predecessor before its first read.
//
// Memory traffic (the floor): T·(68 + slot bytes) + 2·M·H·128 (q, per CTA from L2) + 2·M·H (w) + 2·M·T (out).
// Compute: 2·M·H·128 MMA flops per entry (M·H/16 · 8 m16n8k16 per 8 entries): memory-bound only for small M·H
// (H = 32: at M = 1 ~8 kFLOP per 72 B; at M = 8 the mma.sync f16 rate, not HBM, bounds the scan).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "common.cuh"

namespace {

constexpr int kD = 128;              // index_head_dim
constexpr int kRec = kD / 2 + kD / 32;  // 68 record bytes
constexpr int kMaxM = 8;             // queries per launch
constexpr int kMaxRows = 256;        // M·H query rows
constexpr int kMaxWarps = 8;         // per CTA
constexpr int kMaxSmem = 200 * 1024;
constexpr int kGroupWords = 4 * 32 + 8;  // one 8-entry group in a stage: codes [block][lane] + a scale word per entry

struct ScanArgs {
  const __nv_bfloat16* q;  // [M, H, 128]
  const __nv_bfloat16* w;  // [M, H]
  const uint8_t* pool;     // [entries, 68]
  const void* slots;       // int32 or int64 [T]
  const int* visible;      // int32 [M]
  __nv_bfloat16* out;      // [M, T]
  int T, M, H, slot64, warps;
};

__host__ __device__ __forceinline__ size_t align128(size_t b) { return (b + 127) / 128 * 128; }

// Shared memory: q_frag u32 [R/16 tiles][4 blocks][2 MMAs][32 lanes][4] (the A fragments, one 16-byte load per
// MMA) | w_s bf16 [R] (w · sq of the row) | vis_s int [8] | rings [warps][STAGES][NB · kGroupWords] u32.
__host__ __device__ __forceinline__ size_t smem_layout(int rows, int warps, int nb, int stages, size_t* off_w,
                                                       size_t* off_vis, size_t* off_ring) {
  size_t b = align128(size_t(rows) * kD * 2);
  *off_w = b;
  b = align128(b + size_t(rows) * 2);
  *off_vis = b;
  b = align128(b + kMaxM * 4);
  *off_ring = b;
  return b + size_t(warps) * stages * nb * kGroupWords * 4;
}

using dsv41::cp_async4;
using dsv41::cp_async_commit;
using dsv41::cp_async_wait;

using dsv41::e2m1_pair;  // nibbles -> f16x2 (element J, element J + 4), value · 2^-14

// The UE8M0 scale of block b from an entry's scale word, as the Triton kernel decodes it: (s << 23) as fp32 bits.
__device__ __forceinline__ float scale_of(uint32_t word, int b) {
  return __uint_as_float(((word >> (8 * b)) & 0xFFu) << 23);
}

__device__ __forceinline__ uint32_t f16x2_bits(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// Word of the staged A fragments holding f16x2 word j (elements (8t + j, 8t + j + 4)) of block b of query row
// `row`: mma.sync m16n8k16's A registers of lane (g, t) are (row g, row g + 8) x (k pair 2t, k pair 2t + 8); with
// the block's 32 elements split into two MMAs of 16 (words 0, 1 and 2, 3 of each lane's 8-element slice), lane
// (g, t) of MMA i loads {word 2i of row g, of row g + 8, word 2i + 1 of row g, of row g + 8} in one 16-byte load.
__device__ __forceinline__ int q_frag_word(int row, int b, int t, int j) {
  const int rr = row & 15;
  return ((((row >> 4) * 4 + b) * 2 + (j >> 1)) * 32 + (rr & 7) * 4 + t) * 4 + (j & 1) * 2 + (rr >> 3);
}

// One 32-block of a query row (bf16, global) -> q / sa as f16, written as A-fragment words (see q_frag_word);
// returns sa · 2^14 (the key's bit-placement factor folded in). sa = 2^max(floor(log2 amax) - 15, -126) with amax
// the ROW's max |q| (1 when the row is all zero): cuda/fp8_gemv.cu stage_block_exact's scale, per row instead of
// per block (its header proves the exactness). Called by the 4 consecutive lanes holding blocks 0..3 of the row
// (all 32 lanes of the warp active).
__device__ __forceinline__ float stage_query_block(const __nv_bfloat16* src, uint32_t* frag, int row, int b) {
  float v[32];
  dsv41::load_bf16x32(src, v);
  uint32_t ab = __float_as_uint(dsv41::amax32(v));  // >= 0: the bits order as the values
  ab = max(ab, __shfl_xor_sync(0xFFFFFFFFu, ab, 1));
  ab = max(ab, __shfl_xor_sync(0xFFFFFFFFu, ab, 2));  // the row's amax
  const uint32_t sb = ab == 0 ? 127u : uint32_t(max(int(ab >> 23) - 15, 1));
  const float inv_s = __uint_as_float((254u - sb) << 23);  // 1 / sa exactly (biased 14..253)
#pragma unroll
  for (int t = 0; t < 4; ++t)      // elements 8t..8t+7 of the block: the k slice of lanes (., t)
#pragma unroll
    for (int j = 0; j < 4; ++j)    // f16x2 word j of that slice: elements (8t + j, 8t + j + 4) (moe_fp4's perm8)
      frag[q_frag_word(row, b, t, j)] =
          f16x2_bits(__fmul_rn(v[8 * t + j], inv_s), __fmul_rn(v[8 * t + j + 4], inv_s));
  return __uint_as_float((sb + 14u) << 23);  // biased 15..253: normal
}

// Head sums of a warp step: lane (g, t) holds v[2·grp + c] = its rows' part of entry 8·grp + 2t + c. Reduced over
// the 8 row groups g by a reduce-scatter over the lane bits of g (xor 4, 8, 16: the pairing, and so every sum, of
// an xor butterfly; fp32 adds commute, so each value is one fixed tree: deterministic). Returns the index of the
// value the lane ends with (v[0]) and sets *owner when this lane is the one that stores it.
template <int V>
__device__ __forceinline__ int reduce_scatter_g(float (&v)[V], int g, bool* owner) {
  int idx = 0, n = V;
  bool own = true;
#pragma unroll
  for (int lvl = 0; lvl < 3; ++lvl) {
    const bool upper = (g >> lvl) & 1;
    if (n > 1) {
      const int h = n / 2;
#pragma unroll
      for (int i = 0; i < h; ++i) {
        const float send = upper ? v[i] : v[h + i], keep = upper ? v[h + i] : v[i];
        v[i] = __fadd_rn(keep, __shfl_xor_sync(0xFFFFFFFFu, send, 4 << lvl));
      }
      idx += upper ? h : 0;
      n = h;
    } else {
      v[0] = __fadd_rn(v[0], __shfl_xor_sync(0xFFFFFFFFu, v[0], 4 << lvl));
      own = own && !upper;
    }
  }
  *owner = own;
  return idx;
}

template <int NB, int STAGES>
__global__ void __launch_bounds__(32 * kMaxWarps) indexer_scan_kernel(const ScanArgs a) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int kUnit = NB * 8;  // entries per warp step
  const int R = a.M * a.H, T = a.T;
  size_t off_w, off_vis, off_ring;
  smem_layout(R, a.warps, NB, STAGES, &off_w, &off_vis, &off_ring);
  uint32_t* q_frag = reinterpret_cast<uint32_t*>(smem);
  __nv_bfloat16* w_s = reinterpret_cast<__nv_bfloat16*>(smem + off_w);
  int* vis_s = reinterpret_cast<int*>(smem + off_vis);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int total_warps = gridDim.x * a.warps;  // <= 132·kMaxWarps·ctas: int throughout (T < 2^30)
  const int units = (T + kUnit - 1) / kUnit;
  uint32_t* ring = reinterpret_cast<uint32_t*>(smem + off_ring) + warp * STAGES * NB * kGroupWords;
  // A slot is read as its low 32-bit word (int64 slots: word 2e): exact for every index of a pool that fits in
  // memory (< 2^32 records of 68 B).
  const uint32_t* slots32 = static_cast<const uint32_t*>(a.slots);
  const int slot_shift = a.slot64;

  // Programmatic dependent launch: every input may be the predecessor's output (a no-op without the attribute).
  asm volatile("griddepcontrol.wait;" ::: "memory");

  int u_next = blockIdx.x * a.warps + warp;  // the unit the next issue copies
  auto load_slots = [&](int u, uint32_t (&s)[NB]) {  // slots of entry g of each group of unit u
#pragma unroll
    for (int grp = 0; grp < NB; ++grp) {
      const int e = u < units ? min(u * kUnit + grp * 8 + g, T - 1) : 0;  // entries past T: a valid record
      s[grp] = __ldg(slots32 + (e << slot_shift));
    }
  };
  uint32_t slot_a[NB], slot_b[NB];  // slots of the next unit to issue and of the one after
  load_slots(u_next, slot_a);
  load_slots(u_next + total_warps, slot_b);
  int stage_in = 0;  // ring stage of the next issue
  auto issue = [&]() {  // unit u_next -> stage stage_in (one commit group, empty past the end)
    if (u_next < units) {
      uint32_t* st = ring + stage_in * NB * kGroupWords + lane;
#pragma unroll
      for (int grp = 0; grp < NB; ++grp) {
        const uint8_t* rec = a.pool + size_t(slot_a[grp]) * kRec + 4 * t;
#pragma unroll
        for (int b = 0; b < 4; ++b) cp_async4(st + grp * kGroupWords + b * 32, rec + 16 * b);
        if (t == 0) cp_async4(st - lane + grp * kGroupWords + 128 + g, rec + kD / 2);
      }
    }
    cp_async_commit();
#pragma unroll
    for (int grp = 0; grp < NB; ++grp) slot_a[grp] = slot_b[grp];
    u_next += total_warps;
    load_slots(u_next + total_warps, slot_b);
    stage_in = stage_in == STAGES - 1 ? 0 : stage_in + 1;
  };
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) issue();

  // Stage the queries (one thread per (row, 32-block); R·4 % 64 == 0: whole warps), the head weights times the
  // row's scale sq = sa·2^14 (bf16 · power of two: exact) and the visible counts.
  for (int p = tid; p < R * 4; p += blockDim.x) {
    const int row = p >> 2, b = p & 3;
    const float sq = stage_query_block(a.q + size_t(row) * kD + 32 * b, q_frag, row, b);
    if (b == 0) w_s[row] = __float2bfloat16_rn(__fmul_rn(__bfloat162float(a.w[row]), sq));
  }
  if (tid < kMaxM) vis_s[tid] = tid < a.M ? a.visible[tid] : 0;
  __syncthreads();

  const int H = a.H;
  const uint4* frag4 = reinterpret_cast<const uint4*>(q_frag) + lane;
  int stage_out = 0;
  for (int u = blockIdx.x * a.warps + warp; u < units; u += total_warps) {
    issue();
    cp_async_wait<STAGES - 1>();
    __syncwarp();  // every lane's copies of unit u are visible to the warp (the scale words are shared)
    const uint32_t* st = ring + stage_out * NB * kGroupWords;
    stage_out = stage_out == STAGES - 1 ? 0 : stage_out + 1;
    const int e0 = u * kUnit;

    uint32_t bf[NB][4][4];  // B fragments: [group][block][pair j = elements (8t + j, 8t + j + 4)]
    uint32_t sc[NB][2];     // scale words of entries 2t, 2t + 1 (byte b: block b)
    float skh[NB <= 2 ? NB : 1][4][2];  // their block scales, decoded once per unit where registers allow
#pragma unroll
    for (int grp = 0; grp < NB; ++grp) {
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const uint32_t wd = st[grp * kGroupWords + b * 32 + lane];
        bf[grp][b][0] = e2m1_pair<0>(wd);
        bf[grp][b][1] = e2m1_pair<1>(wd);
        bf[grp][b][2] = e2m1_pair<2>(wd);
        bf[grp][b][3] = e2m1_pair<3>(wd);
      }
      sc[grp][0] = st[grp * kGroupWords + 128 + 2 * t];
      sc[grp][1] = st[grp * kGroupWords + 128 + 2 * t + 1];
      if constexpr (NB <= 2) {
#pragma unroll
        for (int b = 0; b < 4; ++b) {
          skh[grp][b][0] = scale_of(sc[grp][0], b);
          skh[grp][b][1] = scale_of(sc[grp][1], b);
        }
      }
    }
    __syncwarp();  // the stage is consumed: a lane may refill it (next iteration's issue) once all have read it

    for (int m = 0; m < a.M; ++m) {
      float hs[2 * NB];  // [2·grp + c]
#pragma unroll
      for (int i = 0; i < 2 * NB; ++i) hs[i] = 0.f;
      for (int r0 = m * H; r0 < (m + 1) * H; r0 += 16) {  // the query's 16-row MMA tiles
        float acc[NB][4];
#pragma unroll
        for (int grp = 0; grp < NB; ++grp)
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[grp][i] = 0.f;
        const uint4* tile = frag4 + (r0 >> 4) * (4 * 2 * 32);
#pragma unroll
        for (int b = 0; b < 4; ++b) {
          const uint4 a0 = tile[(2 * b) * 32], a1 = tile[(2 * b + 1) * 32];  // the block's two A fragments
#pragma unroll
          for (int grp = 0; grp < NB; ++grp) {
            float cc[4] = {0.f, 0.f, 0.f, 0.f};
            dsv41::mma_f16_16816(cc, a0.x, a0.y, a0.z, a0.w, bf[grp][b][0], bf[grp][b][1]);
            dsv41::mma_f16_16816(cc, a1.x, a1.y, a1.z, a1.w, bf[grp][b][2], bf[grp][b][3]);
            float sk0, sk1;
            if constexpr (NB <= 2) {
              sk0 = skh[grp][b][0];
              sk1 = skh[grp][b][1];
            } else {
              sk0 = scale_of(sc[grp][0], b);
              sk1 = scale_of(sc[grp][1], b);
            }
            acc[grp][0] = fmaf(cc[0], sk0, acc[grp][0]);  // row g, entry 2t
            acc[grp][1] = fmaf(cc[1], sk1, acc[grp][1]);  // row g, entry 2t + 1
            acc[grp][2] = fmaf(cc[2], sk0, acc[grp][2]);  // row g + 8, entry 2t
            acc[grp][3] = fmaf(cc[3], sk1, acc[grp][3]);  // row g + 8, entry 2t + 1
          }
        }
        // acc = dot / sq (sq = the row's sa·2^14, a power of two): bf16(dot) = bf16(acc)·sq and
        // bf16(relu(bf16(dot))·w) = bf16(relu(bf16(acc))·w·sq), the staged weight. Rows (g, g + 8) as a bf16x2.
        const __nv_bfloat162 w2 = __halves2bfloat162(w_s[r0 + g], w_s[r0 + g + 8]);
        const __nv_bfloat162 zero2 = __float2bfloat162_rn(0.f);
#pragma unroll
        for (int grp = 0; grp < NB; ++grp)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const __nv_bfloat162 s2 = __floats2bfloat162_rn(acc[grp][c], acc[grp][2 + c]);  // (row g, row g + 8)
            const __nv_bfloat162 p2 = __hmul2(__hmax2(s2, zero2), w2);  // one rounding: bf16 x bf16 is exact in fp32
            const uint32_t pb = *reinterpret_cast<const uint32_t*>(&p2);
            hs[2 * grp + c] = __fadd_rn(__fadd_rn(hs[2 * grp + c], __uint_as_float(pb << 16)),  // row g
                                        __uint_as_float(pb & 0xFFFF0000u));                  // row g + 8
          }
      }
      bool owner;
      const int idx = reduce_scatter_g(hs, g, &owner);
      const int e = e0 + (idx >> 1) * 8 + 2 * t + (idx & 1);
      if (owner && e < T)
        a.out[size_t(m) * T + e] = e < vis_s[m] ? __float2bfloat16_rn(hs[0]) : __float2bfloat16_rn(-INFINITY);
    }
  }
  cp_async_wait<0>();
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

template <int NB, int STAGES>
cudaError_t launch(const ScanArgs& a, int grid, size_t smem, bool pdl, cudaStream_t stream) {
  static uint64_t smem_set = 0;  // this instance's shared-memory opt-in, per device
  return dsv41::launch_ex(indexer_scan_kernel<NB, STAGES>, &smem_set, kMaxSmem, dim3(grid, 1, 1),
                          dim3(32 * a.warps, 1, 1), smem, stream, 0, pdl, a);
}

}  // namespace

extern "C" {

// Shared memory bytes of one CTA (0 when the parameters are invalid): M queries of H heads (D = 128), `warps`
// warps of `groups` 8-entry groups per step and `stages` ring stages each.
size_t dsv41_indexer_scan_smem(int M, int H, int warps, int groups, int stages) {
  if (M < 1 || M > kMaxM || H < 16 || H % 16 || M * H > kMaxRows || warps < 1 || warps > kMaxWarps ||
      (groups != 1 && groups != 2 && groups != 4) || (stages != 2 && stages != 3 && stages != 4 && stages != 6))
    return 0;
  size_t a, b, c;
  return smem_layout(M * H, warps, groups, stages, &a, &b, &c);
}

// out bf16 [M, T] = index scores of q bf16 [M, H, 128] (16-byte aligned), w bf16 [M, H] against the records
// pool uint8 [*, 68] (4-byte aligned) at slots (int32, or int64 when slot64) [T], -inf where t >= visible[m]
// (int32 [M]). grid CTAs (persistent over the units of 8·groups entries). T = 0 launches nothing. Returns a
// cudaError_t (cudaErrorInvalidValue for parameters outside the contract, before any CUDA call).
int dsv41_indexer_scan(const void* q, const void* w, const void* pool, const void* slots, int slot64,
                       const void* visible, void* out, int M, int H, int T, int warps, int groups, int stages,
                       int grid, int pdl, void* stream) {
  const size_t smem = dsv41_indexer_scan_smem(M, H, warps, groups, stages);
  if (smem == 0 || smem > kMaxSmem || T < 0 || T > (1 << 30) || grid < 1 || (slot64 != 0 && slot64 != 1) ||
      (pdl != 0 && pdl != 1))
    return int(cudaErrorInvalidValue);
  if (reinterpret_cast<uintptr_t>(q) % 16 || reinterpret_cast<uintptr_t>(pool) % 4 ||
      reinterpret_cast<uintptr_t>(slots) % (slot64 ? 8 : 4) || reinterpret_cast<uintptr_t>(out) % 2)
    return int(cudaErrorInvalidValue);
  if (T == 0) return 0;
  ScanArgs a;
  a.q = static_cast<const __nv_bfloat16*>(q);
  a.w = static_cast<const __nv_bfloat16*>(w);
  a.pool = static_cast<const uint8_t*>(pool);
  a.slots = slots;
  a.visible = static_cast<const int*>(visible);
  a.out = static_cast<__nv_bfloat16*>(out);
  a.T = T;
  a.M = M;
  a.H = H;
  a.slot64 = slot64;
  a.warps = warps;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
#define DSV41_SCAN_CASE(NB, S) \
  if (groups == NB && stages == S) return int(launch<NB, S>(a, grid, smem, pdl != 0, s));
  DSV41_SCAN_CASE(1, 2) DSV41_SCAN_CASE(1, 3) DSV41_SCAN_CASE(1, 4) DSV41_SCAN_CASE(1, 6)
  DSV41_SCAN_CASE(2, 2) DSV41_SCAN_CASE(2, 3) DSV41_SCAN_CASE(2, 4) DSV41_SCAN_CASE(2, 6)
  DSV41_SCAN_CASE(4, 2) DSV41_SCAN_CASE(4, 3) DSV41_SCAN_CASE(4, 4) DSV41_SCAN_CASE(4, 6)
#undef DSV41_SCAN_CASE
  return int(cudaErrorInvalidValue);
}

const char* dsv41_indexer_scan_error_string(int err) { return cudaGetErrorString(static_cast<cudaError_t>(err)); }

}  // extern "C"
