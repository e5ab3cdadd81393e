// Sparse MQA decode attention over the packed paged pools, in ONE launch (engine/kernels/sparse_decode.py).
//
// For query m and head h, over the rows r of [swa_idx[m], main_idx[m]] whose slot is not -1 (window rows, then
// top-k rows; one shared K = V head of D = 512):
//
//     l_r = scale * q[m, h] . kv_r        mx = max(max_r l_r, -1e30)        p_r = exp(l_r - mx)
//     o[m, h] = bf16( sum_r bf16(p_r) kv_r / (sum_r p_r + exp(sink[h] - mx)) )
//
// (engine/kernels/sparse_attention.py states the golden P-rounding rule: p rounded to bf16 with the FINAL max,
// the denominator sums the unrounded p; an all-invalid query gives 0 because the denominator is inf.)
// kv_r comes from its record (engine/kernels/cache_records.py): SWA = 512 E4M3 codes + 16 UE8M0 scales per 32
// (528 B), main = 256 bytes of E2M1 pairs (even element in the low nibble) + 32 E4M3 scales per 16 (288 B).
// Both products code x scale are exact in bf16, so the records are dequantised ONCE into shared memory as bf16.
//
// Grid (split s, head block, query m); the `splits` CTAs of one (m, head block) form a thread-block cluster
// (x dimension, <= 8: portable). CTA s owns the combined rows [s R, s R + R) (R = rows_per_split, a multiple
// of 16; row n < KW is window row n, else main row n - KW; slots -1 and rows past KW + KM are zero rows with
// logit -inf). Per CTA (8 warps):
//   1. q[m, heads] -> shared (bf16); the slots and records of its rows -> dequantised bf16 kv [R, 512] in shared
//      memory (warp w dequantises rows w, w + 8, ...; lane c the 16 elements [16c, 16c + 16); all of a warp's
//      record loads are issued before any is decoded: one HBM round trip per 10 rows);
//   2. logits S = q kv^T with mma.sync m16n8k16 bf16 (heads on M, rows on N, D on K), fp32 accumulate; a warp
//      unit = (16 rows, a quarter of D), the 4 quarters summed in fixed order, x scale, -inf for invalid rows;
//      kept in shared memory; local (max, sum exp(l - max)) per head (seed -1e30);
//   3. cluster.sync; every CTA reads all ranks' (max, sum) through DSMEM in rank order -> global max and
//      sum p (rescaled in rank order: the same fp32 result in every CTA), denominator += exp(sink - max);
//   4. p = bf16(exp(l - gmax)) -> shared; P.V with mma.sync (heads on M, D on N, rows on K; warp w owns D columns
//      [64w, 64w + 64)), fp32 in registers, then into shared [HB, 512] (aliasing the kv tile);
//   5. cluster.sync; rank k sums the partials of all ranks in rank order (DSMEM) for its slice of [HB x 512],
//      divides by the denominator, writes bf16 o; cluster.sync before exit (no CTA leaves while read).
// Row tiles of 16 whose slots are all -1 are skipped in both MMAs (their p are 0).
// No global workspace, no atomics: deterministic and CUDA-graph capturable.
//
// Fragment layouts (PTX ISA, mma.m16n8k16 .bf16; g = lane / 4, t = lane % 4):
//   A (16 x 16, row): a0 = A[g][2t, 2t+1], a1 = A[g+8][2t, 2t+1], a2 = A[g][2t+8, 2t+9], a3 = A[g+8][2t+8, 2t+9]
//   B (16 x 8, col):  b0 = B[2t, 2t+1][g], b1 = B[2t+8, 2t+9][g]
//   C (16 x 8):       c0, c1 = C[g][2t, 2t+1], c2, c3 = C[g+8][2t, 2t+1]
// ldmatrix.x4: lane i gives the address of row i % 8 of matrix i / 8; thread lane receives M_j[g][2t, 2t+1] of
// every matrix j (.trans: M_j[2t][g], M_j[2t+1][g]).
//   QK A (q, row-major [h][d]):  matrix j = rows 8(j & 1).., cols 8(j >> 1)..      -> a0..a3
//   QK B (kv [r][d] = B^T):      matrix j = rows 8(j >> 1).., cols 8(j & 1)..      -> (b0, b1) of rows r0..r0+7,
//                                                                                     (b0, b1) of rows r0+8..
//   PV A (p, row-major [h][r]):  as QK A
//   PV B (kv [r][d] = B, .trans): matrix j = rows 8(j & 1).., cols 8(j >> 1)..     -> (b0, b1) of cols d0..d0+7,
//                                                                                     (b0, b1) of cols d0+8..
// Shared rows of kv and q are 520 bf16 (1040 B = 16 x 65) and of p R + 8 (16 x odd bytes): the 8 row addresses of
// every ldmatrix phase hit 8 different 16-byte bank groups.
//
// Memory traffic (the floor): M (KW 528 + KM 288) record bytes + 4 M (KW + KM) index bytes + 2 M H D (q) +
// 2 M H D (o). Each head block re-reads its query's records (from L2). Shared memory per CTA (HB heads):
// max(1040 R, 2080 HB) (kv | fp32 partials) + 1040 HB (q) + 16 HB R (logit quarters) + 2 HB (R + 8) (p) + 4 R
// + 16 HB bytes: 124 KB at HB = 16, R = 80.

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "common.cuh"

namespace cg = cooperative_groups;

namespace {

constexpr int kD = 512;                       // head_dim
constexpr int kSwaRec = kD + kD / 32;         // 528 B
constexpr int kMainRec = kD / 2 + kD / 16;    // 288 B
constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kMaxSplits = 8;                 // portable cluster size
constexpr int kKvStride = kD + 8;             // bf16 per shared kv / q row (1040 B)
constexpr int kPartStride = kD + 8;           // fp32 per shared partial row (2080 B)
constexpr int kDQuarters = 4;                 // QK warp units split D in 4
constexpr int kUB = 10;                       // rows per warp whose record loads are in flight together
constexpr size_t kMaxSmem = 227 * 1024;
constexpr float kSinkFreeMax = -1e30f;

struct Layout {
  size_t kvp, q, lpart, p, slots, stats, gstat, total;
};

// Byte offsets of the shared regions (every size is a multiple of 16 for R % 16 == 0, HB % 16 == 0).
__host__ __device__ inline Layout layout(int hb, int r) {
  Layout L;
  const size_t kv = size_t(r) * kKvStride * 2, part = size_t(hb) * kPartStride * 4;
  L.kvp = 0;                                            // kv bf16 [R][520] | partials fp32 [HB][520]
  L.q = kv > part ? kv : part;                          // q bf16 [HB][520]
  L.lpart = L.q + size_t(hb) * kKvStride * 2;           // logit quarters fp32 [4][HB][R] (final logits in [0])
  L.p = L.lpart + size_t(kDQuarters) * hb * r * 4;      // p bf16 [HB][R + 8]
  L.slots = L.p + size_t(hb) * (r + 8) * 2;             // int [R] (-1: zero row)
  L.stats = L.slots + size_t(r) * 4;                    // fp32 [HB][2]: local max, local sum p
  L.gstat = L.stats + size_t(hb) * 8;                   // fp32 [HB][2]: global max, denominator
  L.total = L.gstat + size_t(hb) * 8;
  return L;
}


__device__ __forceinline__ float2 f16x2_to_float2(uint32_t h) {
  __half2_raw raw;
  raw.x = uint16_t(h & 0xFFFFu);
  raw.y = uint16_t(h >> 16);
  return __half22float2(__half2(raw));
}

// bf16 pair (a in the low half), round to nearest even (exact here: the products fit in bf16).
__device__ __forceinline__ uint32_t pack_bf16(float a, float b) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// E2M1 code (4 bits, bit 3 = sign) x s, exact: the code's bits placed in fp32 read code * 2^-126 (E2M1
// subnormals land on fp32 subnormals; no flush-to-zero in this build), times 2^126 is exact.
__device__ __forceinline__ float e2m1_times(uint32_t c, float s) {
  const float v = __fmul_rn(__uint_as_float(((c & 8u) << 28) | ((c & 7u) << 22)), 8.507059173023462e37f);
  return __fmul_rn(v, s);
}

// 16 SWA elements (16 E4M3 codes, UE8M0 scale byte e) -> 8 bf16 pairs.
__device__ __forceinline__ void decode_swa(const uint4 code, uint32_t e, uint32_t (&out)[8]) {
  const float s = e ? __uint_as_float(e << 23) : __uint_as_float(0x00400000u);  // 2^(e - 127)
  const uint32_t w[4] = {code.x, code.y, code.z, code.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    uint32_t lo, hi;
    dsv41::e4m3x4_to_f16x4(w[k], lo, hi);
    const float2 a = f16x2_to_float2(lo), b = f16x2_to_float2(hi);
    out[2 * k] = pack_bf16(__fmul_rn(a.x, s), __fmul_rn(a.y, s));
    out[2 * k + 1] = pack_bf16(__fmul_rn(b.x, s), __fmul_rn(b.y, s));
  }
}

// 16 main elements (8 bytes of E2M1 pairs, even element in the low nibble; E4M3 scale byte e) -> 8 bf16 pairs.
__device__ __forceinline__ void decode_main(const uint4 code, uint32_t e, uint32_t (&out)[8]) {
  uint32_t lo, hi;
  dsv41::e4m3x4_to_f16x4(e & 0xFFu, lo, hi);
  const float s = f16x2_to_float2(lo).x;
  const uint32_t w[2] = {code.x, code.y};
#pragma unroll
  for (int k = 0; k < 2; ++k)
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      const uint32_t byte = (w[k] >> (8 * b)) & 0xFFu;
      out[4 * k + b] = pack_bf16(e2m1_times(byte & 15u, s), e2m1_times(byte >> 4, s));
    }
}

template <int HB>
__global__ void __launch_bounds__(kThreads, 1) sparse_decode_kernel(
    const __nv_bfloat16* q, const uint8_t* swa_pool, const int* swa_idx, const uint8_t* main_pool,
    const int* main_idx, const float* sink, __nv_bfloat16* o, int H, int KW, int KM, float scale, int R,
    int splits) {
  constexpr int MT = HB / 16;            // m-tiles of 16 heads
  constexpr int TPH = kThreads / HB;     // threads per head in the softmax statistics (16 or 8)
  extern __shared__ __align__(16) unsigned char smem[];
  const Layout L = layout(HB, R);
  __nv_bfloat16* kv_s = reinterpret_cast<__nv_bfloat16*>(smem + L.kvp);
  float* part = reinterpret_cast<float*>(smem + L.kvp);
  __nv_bfloat16* q_s = reinterpret_cast<__nv_bfloat16*>(smem + L.q);
  float* lpart = reinterpret_cast<float*>(smem + L.lpart);
  __nv_bfloat16* p_s = reinterpret_cast<__nv_bfloat16*>(smem + L.p);
  int* slots = reinterpret_cast<int*>(smem + L.slots);
  float* stats = reinterpret_cast<float*>(smem + L.stats);
  float* gstat = reinterpret_cast<float*>(smem + L.gstat);
  const int pstride = R + 8;

  cg::cluster_group cluster = cg::this_cluster();
  const int rank = int(cluster.block_rank());  // == blockIdx.x: the cluster spans the grid's x dimension
  const int m = blockIdx.z, h0 = blockIdx.y * HB;
  const int n_total = KW + KM, n0 = blockIdx.x * R;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;

  // Programmatic dependent launch: q, the slot lists and the pools may all be the previous kernel's output.
  asm volatile("griddepcontrol.wait;" ::: "memory");

  // ---- 1. q and the dequantised rows -> shared ---------------------------------------------------------------
  constexpr int QCH = HB * (kD / 8) / kThreads;  // 16-byte chunks of q per thread
  const uint4* qg = reinterpret_cast<const uint4*>(q + (size_t(m) * H + h0) * kD);
  uint4 qr[QCH];
#pragma unroll
  for (int i = 0; i < QCH; ++i)  // heads past H (a partial head block, H < HB): zero queries, never stored
    qr[i] = h0 + ((tid + i * kThreads) >> 6) < H ? __ldg(qg + tid + i * kThreads) : make_uint4(0u, 0u, 0u, 0u);

  const int rows_w = (R - warp + kWarps - 1) / kWarps;  // this warp's rows: i = warp + 8 j, j < rows_w (R >= 16)
  for (int j0 = 0; j0 < rows_w; j0 += kUB) {
    int slot[kUB];
#pragma unroll
    for (int j = 0; j < kUB; ++j) {
      const int n = n0 + warp + kWarps * (j0 + j);
      slot[j] = -1;
      if (j0 + j < rows_w && n < n_total)
        slot[j] = n < KW ? __ldg(swa_idx + size_t(m) * KW + n) : __ldg(main_idx + size_t(m) * KM + (n - KW));
    }
    uint4 code[kUB];
    uint32_t sc[kUB];
#pragma unroll
    for (int j = 0; j < kUB; ++j) {
      const int n = n0 + warp + kWarps * (j0 + j);
      code[j] = make_uint4(0u, 0u, 0u, 0u);
      sc[j] = 0u;
      if (slot[j] >= 0) {
        if (n < KW) {
          const uint8_t* rec = swa_pool + size_t(slot[j]) * kSwaRec;
          code[j] = __ldg(reinterpret_cast<const uint4*>(rec + 16 * lane));
          sc[j] = __ldg(rec + kD + lane / 2);
        } else {
          const uint8_t* rec = main_pool + size_t(slot[j]) * kMainRec;
          const uint2 v = __ldg(reinterpret_cast<const uint2*>(rec + 8 * lane));
          code[j].x = v.x;
          code[j].y = v.y;
          sc[j] = __ldg(rec + kD / 2 + lane);
        }
      }
    }
    if (j0 == 0) {  // q's stores wait for q's loads only after the first records are in flight
#pragma unroll
      for (int i = 0; i < QCH; ++i) {
        const int c = tid + i * kThreads;  // chunk c: head c / 64, elements [8 (c % 64), + 8)
        *reinterpret_cast<uint4*>(q_s + (c >> 6) * kKvStride + 8 * (c & 63)) = qr[i];
      }
    }
#pragma unroll
    for (int j = 0; j < kUB; ++j) {
      if (j0 + j < rows_w) {
        const int i = warp + kWarps * (j0 + j);
        const int n = n0 + i;
        uint32_t out[8];
        if (n < KW) {
          decode_swa(code[j], sc[j], out);  // a zero row (slot -1) decodes to zeros: codes 0
        } else {
          decode_main(code[j], sc[j], out);
        }
        uint4* dst = reinterpret_cast<uint4*>(kv_s + i * kKvStride + 16 * lane);
        dst[0] = make_uint4(out[0], out[1], out[2], out[3]);
        dst[1] = make_uint4(out[4], out[5], out[6], out[7]);
        if (lane == 0) slots[i] = slot[j];
      }
    }
  }
  __syncthreads();

  // ---- 2. logits: S[h][r] = q[h] . kv[r] per (16-row tile, D quarter) ----------------------------------------
  const int n_rt = R / 16;
  for (int u = warp; u < n_rt * kDQuarters; u += kWarps) {
    const int rt = u / kDQuarters, ks = u % kDQuarters;
    const int r0 = rt * 16;
    if (!__any_sync(0xFFFFFFFFu, slots[r0 + (lane & 15)] >= 0)) continue;  // 16 zero rows: logits -inf
    float acc[MT][2][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.f;
#pragma unroll 2
    for (int kk = 0; kk < kD / kDQuarters / 16; ++kk) {
      const int k0 = ks * (kD / kDQuarters) + kk * 16;
      uint32_t b[4];
      dsv41::ldmatrix_x4(b, kv_s + (r0 + (lane & 7) + 8 * (lane >> 4)) * kKvStride + k0 + 8 * ((lane >> 3) & 1));
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        uint32_t a[4];
        dsv41::ldmatrix_x4(a, q_s + (16 * mt + (lane & 7) + 8 * ((lane >> 3) & 1)) * kKvStride + k0 + 8 * (lane >> 4));
        dsv41::mma_bf16_16816(acc[mt][0], a[0], a[1], a[2], a[3], b[0], b[1]);
        dsv41::mma_bf16_16816(acc[mt][1], a[0], a[1], a[2], a[3], b[2], b[3]);
      }
    }
    float* lp = lpart + size_t(ks) * HB * R;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const int h = 16 * mt + g, r = r0 + 8 * nt + 2 * t;
        *reinterpret_cast<float2*>(lp + h * R + r) = make_float2(acc[mt][nt][0], acc[mt][nt][1]);
        *reinterpret_cast<float2*>(lp + (h + 8) * R + r) = make_float2(acc[mt][nt][2], acc[mt][nt][3]);
      }
  }
  __syncthreads();

  // final logits (quarters summed in order, x scale, -inf for zero rows) and the local statistics per head
  {
    const int h = tid / TPH, j = tid % TPH;
    const size_t qs = size_t(HB) * R;
    float* lh = lpart + h * R;
    float mx = kSinkFreeMax;
    for (int r = j; r < R; r += TPH) {
      float l = __uint_as_float(0xFF800000u);  // -inf
      if (slots[r] >= 0) l = __fmul_rn(__fadd_rn(__fadd_rn(__fadd_rn(lh[r], lh[r + qs]), lh[r + 2 * qs]),
                                                 lh[r + 3 * qs]), scale);
      lh[r] = l;
      mx = fmaxf(mx, l);
    }
#pragma unroll
    for (int off = TPH / 2; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, off));
    float sum = 0.f;
    for (int r = j; r < R; r += TPH) sum = __fadd_rn(sum, expf(lh[r] - mx));  // exp(-inf) = 0
#pragma unroll
    for (int off = TPH / 2; off > 0; off >>= 1) sum = __fadd_rn(sum, __shfl_xor_sync(0xFFFFFFFFu, sum, off));
    if (j == 0) {
      stats[2 * h] = mx;
      stats[2 * h + 1] = sum;
    }
  }
  cluster.sync();  // 3. every rank's statistics are visible

  if (tid < HB) {
    float2 st[kMaxSplits];  // every rank's (max, sum): all remote loads in flight together
#pragma unroll
    for (int k = 0; k < kMaxSplits; ++k)
      st[k] = k < splits ? *reinterpret_cast<const float2*>(cluster.map_shared_rank(stats, k) + 2 * tid)
                         : make_float2(kSinkFreeMax, 0.f);
    float gm = kSinkFreeMax;
#pragma unroll
    for (int k = 0; k < kMaxSplits; ++k) gm = fmaxf(gm, st[k].x);
    float gs = 0.f;
#pragma unroll
    for (int k = 0; k < kMaxSplits; ++k)
      if (k < splits) gs = __fadd_rn(gs, __fmul_rn(st[k].y, expf(st[k].x - gm)));
    gstat[2 * tid] = gm;
    const float sk = h0 + tid < H ? sink[h0 + tid] : 0.f;  // a head past H: any finite sink
    gstat[2 * tid + 1] = __fadd_rn(gs, expf(sk - gm));  // all rows invalid: exp(sink + 1e30) = inf
  }
  __syncthreads();

  // ---- 4. p = bf16(exp(l - gmax)); P.V ------------------------------------------------------------------------
  for (int e = tid; e < HB * R; e += kThreads) {
    const int h = e / R, r = e - (e / R) * R;
    p_s[h * pstride + r] = __float2bfloat16_rn(expf(lpart[h * R + r] - gstat[2 * h]));
  }
  __syncthreads();

  float acc[MT][8][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.f;
  const int d0w = warp * 64;
  for (int rt = 0; rt < n_rt; ++rt) {
    const int r0 = rt * 16;
    if (!__any_sync(0xFFFFFFFFu, slots[r0 + (lane & 15)] >= 0)) continue;  // p = 0 there
    uint32_t a[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
      dsv41::ldmatrix_x4(a[mt], p_s + (16 * mt + (lane & 7) + 8 * ((lane >> 3) & 1)) * pstride + r0 + 8 * (lane >> 4));
#pragma unroll
    for (int np = 0; np < 4; ++np) {
      uint32_t b[4];
      dsv41::ldmatrix_x4_trans(b, kv_s + (r0 + (lane & 7) + 8 * ((lane >> 3) & 1)) * kKvStride + d0w + 16 * np +
                           8 * (lane >> 4));
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        dsv41::mma_bf16_16816(acc[mt][2 * np], a[mt][0], a[mt][1], a[mt][2], a[mt][3], b[0], b[1]);
        dsv41::mma_bf16_16816(acc[mt][2 * np + 1], a[mt][0], a[mt][1], a[mt][2], a[mt][3], b[2], b[3]);
      }
    }
  }
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  __syncthreads();  // every warp is done with kv_s: the partials overwrite it
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      const int h = 16 * mt + g, d = d0w + 8 * nt + 2 * t;
      *reinterpret_cast<float2*>(part + h * kPartStride + d) = make_float2(acc[mt][nt][0], acc[mt][nt][1]);
      *reinterpret_cast<float2*>(part + (h + 8) * kPartStride + d) = make_float2(acc[mt][nt][2], acc[mt][nt][3]);
    }
  cluster.sync();  // 5. every rank's partials are visible

  constexpr int kChunks = HB * (kD / 4);  // float4 chunks of [HB][512]
  for (int c = rank * kThreads + tid; c < kChunks; c += splits * kThreads) {
    const int h = c / (kD / 4), d = (c % (kD / 4)) * 4;
    float4 v[kMaxSplits];  // all ranks' loads in flight together, summed in rank order
#pragma unroll
    for (int k = 0; k < kMaxSplits; ++k)
      if (k < splits) v[k] = *reinterpret_cast<const float4*>(cluster.map_shared_rank(part, k) + h * kPartStride + d);
    float4 s = v[0];
#pragma unroll
    for (int k = 1; k < kMaxSplits; ++k) {
      if (k < splits) {
        s.x = __fadd_rn(s.x, v[k].x);
        s.y = __fadd_rn(s.y, v[k].y);
        s.z = __fadd_rn(s.z, v[k].z);
        s.w = __fadd_rn(s.w, v[k].w);
      }
    }
    const float den = gstat[2 * h + 1];  // an all-invalid query: 0 / inf = 0
    uint2 out;
    out.x = pack_bf16(__fdiv_rn(s.x, den), __fdiv_rn(s.y, den));
    out.y = pack_bf16(__fdiv_rn(s.z, den), __fdiv_rn(s.w, den));
    if (h0 + h < H) *reinterpret_cast<uint2*>(o + (size_t(m) * H + h0 + h) * kD + d) = out;
  }
  cluster.sync();  // no CTA leaves while another still reads its shared memory
}

template <int HB>
cudaError_t launch(const void* q, const void* swa_pool, const void* swa_idx, const void* main_pool,
                   const void* main_idx, const void* sink, void* o, int M, int H, int KW, int KM, float scale, int R,
                   int splits, bool pdl, size_t smem, cudaStream_t stream) {
  static uint64_t smem_set = 0;  // this instance's shared-memory opt-in, per device
  return dsv41::launch_ex(sparse_decode_kernel<HB>, &smem_set, int(kMaxSmem), dim3(splits, (H + HB - 1) / HB, M),
                          dim3(kThreads, 1, 1), smem, stream, splits /* always a cluster (also of 1): the kernel
                          syncs it */, pdl, static_cast<const __nv_bfloat16*>(q), static_cast<const uint8_t*>(swa_pool),
                          static_cast<const int*>(swa_idx), static_cast<const uint8_t*>(main_pool),
                          static_cast<const int*>(main_idx), static_cast<const float*>(sink),
                          static_cast<__nv_bfloat16*>(o), H, KW, KM, scale, R, splits);
}

}  // namespace

extern "C" {

// Shared memory bytes of one CTA (0 when the parameters are invalid); the Python wrapper checks its limit.
size_t dsv41_sparse_decode_smem(int heads_per_cta, int rows_per_split) {
  if ((heads_per_cta != 16 && heads_per_cta != 32) || rows_per_split < 16 || rows_per_split % 16) return 0;
  return layout(heads_per_cta, rows_per_split).total;
}

// o [M, H, 512] bf16 = sparse MQA attention of q [M, H, 512] bf16 over the rows listed by swa_idx [M, KW] (int32
// slots of swa_pool, 528-byte records) then main_idx [M, KM] (slots of main_pool, 288-byte records), -1 = none,
// with sink [H] fp32 (see the header). heads_per_cta 16 or 32 with H % heads_per_cta == 0, or 16 with H < 16 (one
// partial head block: a rank's heads under tensor parallelism, 8 at N = 8); rows_per_split R: a
// multiple of 16; splits = ceil((KW + KM) / R) <= 8 (the cluster). Pools and q 16-byte aligned, o 8-byte aligned.
// Returns a cudaError_t (cudaErrorInvalidValue for parameters outside the contract, before any CUDA call).
int dsv41_sparse_decode(const void* q, const void* swa_pool, const void* swa_idx, const void* main_pool,
                        const void* main_idx, const void* sink, void* o, int M, int H, int KW, int KM, float scale,
                        int heads_per_cta, int rows_per_split, int splits, int pdl, void* stream) {
  const size_t smem = dsv41_sparse_decode_smem(heads_per_cta, rows_per_split);
  if (smem == 0 || smem > kMaxSmem) return int(cudaErrorInvalidValue);
  const bool partial = heads_per_cta == 16 && H >= 1 && H < 16;
  if (M < 1 || M > 65535 || (!partial && (H < heads_per_cta || H % heads_per_cta)) || H / heads_per_cta > 65535 ||
      KW < 0 ||
      KM < 0 || KW + KM < 1 || splits < 1 || splits > kMaxSplits || (pdl != 0 && pdl != 1))
    return int(cudaErrorInvalidValue);
  const int n_total = KW + KM;
  if ((n_total + rows_per_split - 1) / rows_per_split != splits) return int(cudaErrorInvalidValue);
  if ((reinterpret_cast<uintptr_t>(q) | reinterpret_cast<uintptr_t>(swa_pool) |
       reinterpret_cast<uintptr_t>(main_pool)) % 16 || reinterpret_cast<uintptr_t>(o) % 8 ||
      reinterpret_cast<uintptr_t>(swa_idx) % 4 || reinterpret_cast<uintptr_t>(main_idx) % 4)
    return int(cudaErrorInvalidValue);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (heads_per_cta == 16)
    return int(launch<16>(q, swa_pool, swa_idx, main_pool, main_idx, sink, o, M, H, KW, KM, scale,
                          rows_per_split, splits, pdl != 0, smem, s));
  return int(launch<32>(q, swa_pool, swa_idx, main_pool, main_idx, sink, o, M, H, KW, KM, scale, rows_per_split,
                        splits, pdl != 0, smem, s));
}

const char* dsv41_sparse_decode_error_string(int err) { return cudaGetErrorString(static_cast<cudaError_t>(err)); }

}  // extern "C"
