// Routed-expert FP4 GEMVs for decode (engine/kernels/moe_fp4.py): the grouped W1|W3 + SwiGLU ("up") and W2
// ("down") products of a MoE layer over tiles of at most 8 (token, expert) pairs of one expert; before them the
// router's top-k (route_kernel) and the grouping plan with the activations' quantisation (plan_quant_kernel).
//
//   up:    g, u = bf16(A(x) · W1_e^T), bf16(A(x) · W3_e^T);  h = bf16(w · silu(min(g, L)) · clamp(u, ±L))
//          written act-quantised (E4M3 codes as f16 + one UE8M0 scale per 32), the input of down
//   down:  o = A(h) · W2_e^T in fp32, by pair
//
// A = act_quant (E4M3 codes, power-of-two scale per 32 along K). W = packed E2M1 [rows, K/2] (even element in
// the low nibble) with one E8M0 scale per row per 32 along K. Products: an E2M1 nibble becomes the f16 whose
// bits are the nibble moved into place (value · 2^-14, exact), an E4M3 code is exact in f16, so mma.sync
// m16n8k16 (f16 in, f32 accumulate) sums exact products; the f32 block sum is scaled by sw · 2^14 · sa per
// 32-block in fp32, the fp32 accumulation order of engine.kernels.moe (block partials in K order).
//
// Data path (why it streams): each warp owns 32 weight rows (two 16-row MMA tiles: W1 and W3 rows of the same
// 16 outputs for up, 32 consecutive rows for down) and a K range; it streams 128-element chunks (64 bytes per
// row) into a private multi-stage shared-memory ring with cp.async (16-byte copies, rows XOR-swizzled so that
// ldmatrix is conflict-free) and reads them back with ldmatrix.x4, which hands thread (g, t) bytes 4t..4t+3 of
// one 32-block of rows g and g + 8: 8 consecutive K elements, as one MMA pair needs. The activations of the
// tile's tokens sit in shared memory with each group of 8 stored as [0, 4, 1, 5, 2, 6, 3, 7]: the order in
// which the nibble conversion produces f16 pairs (elements j, j + 4 of a 32-bit word), so one 16-byte load
// gives a thread both MMAs' B fragments (the MMA's k order is a permutation that is the same for A and B).
// quant_rows writes activations in that order; up's epilogue writes h in it.
//
// Work: CTA (split, row block, tile); warps_n x warps_k warps; a cluster of `splits` CTAs splits K further;
// partials are summed in a fixed order (warps through shared memory, then cluster ranks through DSMEM):
// deterministic, no workspace, no atomics, CUDA-graph capturable. Programmatic dependent launch: the first
// weight chunks (which depend only on the plan, complete two launches earlier) are in flight before the
// kernel waits for its predecessor; activations are read after the wait.
// Memory traffic (the floor): the used experts' weight bytes + scales (rows · K/2 + rows · K/32 each),
// plus activations (2 · rows_x · K per CTA from L2) and outputs.

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "common.cuh"

namespace cg = cooperative_groups;

namespace {

constexpr int kFrag = 8;            // pairs per MMA fragment: the MMA's N
constexpr int kMaxM = 32;           // pairs per tile: up to 4 fragments (a weight fragment feeds each)
constexpr int kMaxWarps = 8;        // per CTA
constexpr int kMaxSplits = 8;       // portable cluster size
constexpr int kMaxSmem = 200 * 1024;
constexpr int kPlanThreads = 256;  // plan_quant_kernel's block
constexpr int kChunk = 128;         // K elements per pipeline stage (4 blocks of 32)
constexpr int kRowBytes = kChunk / 2;                   // 64 weight bytes per row per stage
constexpr int kWarpRows = 32;                           // weight rows per warp
constexpr int kStageBytes = kWarpRows * kRowBytes + kWarpRows * 4;  // weights + 4 scale bytes per row

struct MoeArgs {
  const uint8_t* w;          // [E, rows_e, K/2] packed E2M1
  const uint8_t* ws;         // [E, rows_e, K/32] E8M0
  const __half* xq;          // activations, E4M3 codes as f16 in the permuted order [rows, K]
  const float* xs;           // their scales [rows, K/32]
  const int* sorted_pairs;   // [R]
  const int* tile_e;         // [tiles]
  const int* tile_start;     // [tiles]
  const int* tile_rows;      // [tiles]
  const float* rw;           // routing weight by pair [R] (up)
  __half* hq;                // up: h codes [R, N] by sorted row
  float* hs;                 // up: h scales [R, N/32]
  __nv_bfloat16* h_raw;      // up, optional: h before quantisation [R, N] (natural order)
  float* out;                // down: fp32 [R, N] by pair
  int n_out;                 // up: I (h columns); down: D
  int K;
  int topk;
  float limit;
  int kc;                    // K elements per CTA (multiple of kChunk)
  int x_rows;                // activation rows held in shared memory (max pairs of a tile)
  int warps_n, warps_k, splits;
};

using dsv41::x_stride;

__host__ __device__ __forceinline__ size_t align128(size_t b) { return (b + 127) / 128 * 128; }

// Pairs of a tile of at most x_rows pairs, in whole fragments: 8, 16 or 32 (the kernel's template MT = this / 8).
__host__ __device__ __forceinline__ int tile_m(int x_rows) { return x_rows <= 8 ? 8 : x_rows <= 16 ? 16 : 32; }

// Shared memory: x_s f16 [x_rows][stride] | sa_s f32 [kc/32][M] | red f32 [warps_k][M][warps_n*32] | rings,
// M = tile_m(x_rows)
__host__ __device__ __forceinline__ size_t smem_layout(int kc, int x_rows, int warps_n, int warps_k, int stages,
                                                       size_t* off_sa, size_t* off_red, size_t* off_ring) {
  const int m = tile_m(x_rows);
  size_t b = align128(size_t(x_rows) * x_stride(kc) * 2);
  *off_sa = b;
  b = align128(b + size_t(kc / 32) * m * 4);
  *off_red = b;
  b = align128(b + size_t(warps_k) * m * warps_n * kWarpRows * 4);
  *off_ring = b;
  return b + size_t(warps_n) * warps_k * stages * kStageBytes;
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
}

using dsv41::cp_async4;
using dsv41::cp_async_commit;
using dsv41::cp_async_wait;
using dsv41::e2m1_pair;
using dsv41::perm8;

__device__ __forceinline__ float e8m0_x16384(uint32_t code) { return __uint_as_float((code + 14u) << 23); }

// act_quant of the 32-block b of row r: x bf16 [rows, K] -> codes f16 [rows, K] (permuted order) + scale.
__device__ void quant_block32(const __nv_bfloat16* __restrict__ x, __half* __restrict__ xq, float* __restrict__ xs,
                              int r, int b, int K) {
  float v[32];
  dsv41::load_bf16x32(x + size_t(r) * K + b * 32, v);
  const uint32_t e = dsv41::act_scale_exp(dsv41::amax32(v));
  const float inv_s = __uint_as_float((254u - e) << 23);
  uint32_t out[16];
#pragma unroll
  for (int grp = 0; grp < 4; ++grp)
#pragma unroll
    for (int j = 0; j < 4; ++j)  // stored pair j of group grp: elements (j, j + 4)
      out[4 * grp + j] = dsv41::e4m3_pair_f16(v[8 * grp + j], v[8 * grp + j + 4], inv_s);
  uint4* dst = reinterpret_cast<uint4*>(xq + size_t(r) * K + b * 32);
#pragma unroll
  for (int i = 0; i < 4; ++i) dst[i] = make_uint4(out[4 * i], out[4 * i + 1], out[4 * i + 2], out[4 * i + 3]);
  xs[size_t(r) * (K / 32) + b] = __uint_as_float(e << 23);
}

// One thread per 32-block: quant_rows.
__global__ void quant_rows_kernel(const __nv_bfloat16* __restrict__ x, __half* __restrict__ xq,
                                  float* __restrict__ xs, int rows, int K) {
  const int blocks = K / 32;
  const int idx = blockIdx.x * blockDim.x + threadIdx.x;
  if (idx < rows * blocks) quant_block32(x, xq, xs, idx / blocks, idx % blocks, K);
}

// The grouping plan of engine.kernels.moe.moe_plan (bit for bit: a stable counting sort of the R pairs by expert,
// dropped pairs (id -1) left out, expert e owning ceil(count_e / bm) consecutive tiles of bm sorted rows; tiles
// past the total get 0 rows), computed by block 0 of the launch; the other blocks run quant_rows on x. Shared
// memory: counts, segment starts, tile ends and pairs placed so far per expert (4 E ints), then one chunk's
// expert ids (blockDim ints).
__device__ void plan_block(const int* __restrict__ ids, int R, int E, int bm, int max_tiles, int* __restrict__ sorted,
                           int* __restrict__ tile_e, int* __restrict__ tile_start, int* __restrict__ tile_rows,
                           int* sm) {
  int* count = sm;
  int* seg = sm + E;
  int* tend = sm + 2 * E;
  int* placed = sm + 3 * E;
  int* chunk_ids = sm + 4 * E;
  const int tid = threadIdx.x;
  for (int e = tid; e < E; e += blockDim.x) count[e] = placed[e] = 0;
  for (int p = tid; p < R; p += blockDim.x) sorted[p] = 0;
  __syncthreads();
  for (int p = tid; p < R; p += blockDim.x) {
    const int e = ids[p];
    if (e >= 0 && e < E) atomicAdd(&count[e], 1);
  }
  __syncthreads();
  if (tid < 32) {  // exclusive scan of counts and inclusive scan of tiles, one warp, lanes own runs of experts
    const int lane = tid;
    const int per = (E + 31) / 32;
    const int lo = min(lane * per, E), hi = min(lo + per, E);
    int c = 0, tl = 0;
    for (int e = lo; e < hi; ++e) {
      c += count[e];
      tl += (count[e] + bm - 1) / bm;
    }
    int c_ex = c, t_ex = tl;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int cu = __shfl_up_sync(0xFFFFFFFFu, c_ex, o), tu = __shfl_up_sync(0xFFFFFFFFu, t_ex, o);
      if (lane >= o) {
        c_ex += cu;
        t_ex += tu;
      }
    }
    c_ex -= c;  // exclusive
    t_ex -= tl;
    for (int e = lo; e < hi; ++e) {
      seg[e] = c_ex;
      c_ex += count[e];
      t_ex += (count[e] + bm - 1) / bm;
      tend[e] = t_ex;
    }
  }
  __syncthreads();
  // Stable placement, linear in R: the pairs in chunks of blockDim.x, in order. A pair's rank among its expert's
  // pairs = those placed by earlier chunks (placed[e]) + those before it in its own chunk (from shared memory).
  for (int c0 = 0; c0 < R; c0 += blockDim.x) {
    const int p = c0 + tid;
    const int e = p < R ? ids[p] : -1;
    const bool ok = e >= 0 && e < E;
    chunk_ids[tid] = ok ? e : -1;
    __syncthreads();
    if (ok) {
      int rank = placed[e];
      for (int q = 0; q < tid; ++q) rank += (chunk_ids[q] == e);
      sorted[seg[e] + rank] = p;
    }
    __syncthreads();  // every rank read placed[] before this chunk's pairs are added to it
    if (ok) atomicAdd(&placed[e], 1);
    __syncthreads();
  }
  const int total = tend[E - 1];
  for (int t = tid; t < max_tiles; t += blockDim.x) {
    int e = 0, s = 0, rows = 0;
    if (t < total) {
      int lo = 0, hi = E - 1;  // the first expert with tend > t
      while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (tend[mid] > t) hi = mid; else lo = mid + 1;
      }
      e = lo;
      const int local = t - (tend[e] - (count[e] + bm - 1) / bm);
      s = seg[e] + local * bm;
      rows = min(count[e] - local * bm, bm);
    }
    tile_e[t] = e;
    tile_start[t] = s;
    tile_rows[t] = rows;
  }
}

// Block 0: the plan; blocks 1..: quant_rows of x (one thread per 32-block).
__global__ void __launch_bounds__(kPlanThreads)
    plan_quant_kernel(const int* __restrict__ ids, int R, int E, int bm, int max_tiles, int* __restrict__ sorted,
                      int* __restrict__ tiles, const __nv_bfloat16* __restrict__ x, __half* __restrict__ xq,
                      float* __restrict__ xs, int rows, int K) {
  extern __shared__ int plan_smem[];
  if (blockIdx.x == 0) {
    plan_block(ids, R, E, bm, max_tiles, sorted, tiles, tiles + max_tiles, tiles + 2 * max_tiles, plan_smem);
    return;
  }
  const int idx = (blockIdx.x - 1) * blockDim.x + threadIdx.x;
  const int blocks = K / 32;
  if (idx < rows * blocks) quant_block32(x, xq, xs, idx / blocks, idx % blocks, K);
}

constexpr int kRouteMaxExperts = 1024;  // one thread per expert
constexpr int kRouteMaxTopk = 32;
constexpr int kRouteLoads = 32;         // split partials in flight per thread before they are summed in order

// An order-preserving key of a biased score: larger scores give larger keys; 0 (below every key of a number) for
// -inf and NaN, which are never picked.
__device__ __forceinline__ uint32_t route_key(float b) {
  if (!(b > -INFINITY)) return 0u;
  const uint32_t u = __float_as_uint(b);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The best (key, expert) of a warp: the largest key, the lowest expert among equal keys (two redux.sync).
__device__ __forceinline__ void route_warp_best(uint32_t& key, int& e) {
  const uint32_t best = __reduce_max_sync(0xFFFFFFFFu, key);
  e = int(__reduce_min_sync(0xFFFFFFFFu, key == best ? uint32_t(e) : 0xFFFFFFFFu));
  key = best;
}

// The router after the gate (engine.kernels.moe.route_scores' math), one CTA per token, one thread per expert, so
// that every split partial is loaded at once. z[e] = the gate's split partials summed in split order;
// score = sqrt(softplus(z)); top-k of score + bias by repeated argmax (the lowest expert id among exact ties): per
// round a warp argmax (redux.sync on order-preserving keys), the warps' winners through 2 x 32 slots of shared
// memory (alternating, one barrier per round) and a second warp argmax; weights = the selected raw scores,
// normalised by their sum (slot order) + 1e-20 when norm, times route_scale.
__global__ void __launch_bounds__(kRouteMaxExperts) route_kernel(const float* __restrict__ part,
                                                                 const float* __restrict__ bias,
                                                                 float* __restrict__ w_out, int* __restrict__ ids_out,
                                                                 int splits, int T, int E, int topk,
                                                                 float route_scale, int norm) {
  __shared__ uint32_t win_key[2][32];
  __shared__ int win_e[2][32];
  __shared__ float sel_s[kRouteMaxTopk];
  const int t = blockIdx.x, e = threadIdx.x, lane = e & 31, warp = e >> 5, warps = blockDim.x >> 5;
  const size_t split_stride = size_t(T) * E;
  const float* p = part + size_t(t) * E + e;
  float z = 0.f;
  if (e < E) {
    for (int s0 = 0; s0 < splits; s0 += kRouteLoads) {  // kRouteLoads loads issued, then added in split order
      float v[kRouteLoads];
#pragma unroll
      for (int i = 0; i < kRouteLoads; ++i) v[i] = s0 + i < splits ? p[size_t(s0 + i) * split_stride] : 0.f;
#pragma unroll
      for (int i = 0; i < kRouteLoads; ++i)
        if (s0 + i < splits) z = __fadd_rn(z, v[i]);
    }
  }
  const float score = sqrtf(fmaxf(z, 0.f) + log1pf(expf(-fabsf(z))));  // sqrt(softplus(z)), IEEE sqrt
  uint32_t key = e < E ? route_key(__fadd_rn(score, bias[e])) : 0u;
  int sel_id = 0;  // thread i < topk: slot i's expert
  for (int i = 0; i < topk; ++i) {
    uint32_t k = key;
    int best = e;
    route_warp_best(k, best);
    if (lane == 0) {
      win_key[i & 1][warp] = k;
      win_e[i & 1][warp] = best;
    }
    __syncthreads();
    k = lane < warps ? win_key[i & 1][lane] : 0u;
    best = lane < warps ? win_e[i & 1][lane] : E;
    route_warp_best(k, best);
    if (k == 0u) best = 0;  // every remaining biased score is -inf or NaN (E < topk cannot happen): expert 0
    if (e == best) {
      key = 0u;
      sel_s[i] = score;
    }
    if (e == i) sel_id = best;
  }
  __syncthreads();  // sel_s
  if (warp != 0) return;  // the slots are threads 0 .. topk - 1 of warp 0
  const float sel_w = lane < topk ? sel_s[lane] : 0.f;
  float denom = 1.f;
  if (norm) {
    float sum = 0.f;
    for (int i = 0; i < topk; ++i) sum = __fadd_rn(sum, __shfl_sync(0xFFFFFFFFu, sel_w, i));  // slot order
    denom = __fadd_rn(sum, 1e-20f);
  }
  if (lane < topk) {
    const float wv = norm ? __fdiv_rn(sel_w, denom) : sel_w;
    w_out[size_t(t) * topk + lane] = __fmul_rn(wv, route_scale);
    ids_out[size_t(t) * topk + lane] = sel_id;
  }
}

// MT fragments of 8 pairs per tile (M = 8 MT pairs): each weight fragment, converted once, feeds MT MMAs. Every
// output element is the same sequence of operations whatever MT is, so the results do not depend on the tile size.
template <bool UP, int STAGES, int MT>
__global__ void __launch_bounds__(32 * kMaxWarps) moe_fp4_kernel(const MoeArgs a) {
  constexpr int M = MT * kFrag;
  extern __shared__ __align__(128) unsigned char smem[];
  const int tile = blockIdx.z;
  const int n_rows = a.tile_rows[tile];
  if (n_rows <= 0) return;  // every CTA of the cluster has the same tile: they leave together
  const int expert = a.tile_e[tile];
  const int row0 = a.tile_start[tile];

  const int kc = a.kc;
  const int stride = x_stride(kc);
  size_t off_sa, off_red, off_ring;
  smem_layout(kc, a.x_rows, a.warps_n, a.warps_k, STAGES, &off_sa, &off_red, &off_ring);
  __half* x_s = reinterpret_cast<__half*>(smem);
  float* sa_s = reinterpret_cast<float*>(smem + off_sa);
  float* red = reinterpret_cast<float*>(smem + off_red);

  const int K = a.K, N = a.n_out;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int wn = warp % a.warps_n, wk = warp / a.warps_n;
  const int split = blockIdx.x;
  const int k0 = split * kc;
  const int kc_valid = min(kc, K - k0);
  const int nch = kc_valid / kChunk;
  const int per = (nch + a.warps_k - 1) / a.warps_k;
  const int c_lo = min(wk * per, nch), c_hi = min(c_lo + per, nch);
  const int rows_cta_w = a.warps_n * kWarpRows;  // weight rows of the CTA (the partials' row dimension)
  // The warp's 32 weight rows: up: W1 rows o0 .. o0 + 15 then the W3 rows of the same outputs; down: o0 .. o0 + 31
  const int o0 = blockIdx.y * a.warps_n * (UP ? 16 : 32) + wn * (UP ? 16 : 32);
  const int rows_e = UP ? 2 * N : N;
  auto weight_row = [&](int r) -> int {  // local row 0..31 -> row of the expert's matrix (clamped)
    if (UP) return (r >> 4) * N + min(o0 + (r & 15), N - 1);
    return min(o0 + r, N - 1);
  };
  const uint8_t* w_e = a.w + size_t(expert) * rows_e * (K / 2);
  const uint8_t* s_e = a.ws + size_t(expert) * rows_e * (K / 32);
  const uint8_t* wrow[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) wrow[j] = w_e + size_t(weight_row(g + 8 * j)) * (K / 2) + (t << 4);
  const uint8_t* srow = s_e + size_t(weight_row(lane)) * (K / 32);
  unsigned char* ring = smem + off_ring + size_t(warp) * STAGES * kStageBytes;

  auto issue = [&](int c) {
    if (c < c_hi) {
      unsigned char* st = ring + (c % STAGES) * kStageBytes;
      const int kel = k0 + c * kChunk;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int r = g + 8 * j;
        cp_async16(st + r * kRowBytes + ((t ^ ((r >> 1) & 3)) << 4), wrow[j] + kel / 2);
      }
      cp_async4(st + kWarpRows * kRowBytes + lane * 4, srow + kel / 32);
    }
    cp_async_commit();  // (an empty group past the end keeps the wait count uniform)
  };
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) issue(c_lo + s);

  // Programmatic dependent launch: the plan and the weights are ready; the activations are the previous
  // kernel's output (a no-op without the launch attribute).
  asm volatile("griddepcontrol.wait;" ::: "memory");

  const int kbc = kc / 32;
  for (int p = tid; p < a.x_rows * (kc_valid / 8); p += blockDim.x) {
    const int j = p / (kc_valid / 8), q8 = p % (kc_valid / 8);
    if (j < n_rows) {
      const int src_row = UP ? a.sorted_pairs[row0 + j] / a.topk : row0 + j;
      *reinterpret_cast<uint4*>(x_s + j * stride + q8 * 8) =
          *reinterpret_cast<const uint4*>(a.xq + size_t(src_row) * K + k0 + q8 * 8);
    }
  }
  for (int p = tid; p < M * kbc; p += blockDim.x) {
    const int j = p % M, kb = p / M;
    float s = 0.f;
    if (j < n_rows && kb < kc_valid / 32) {
      const int src_row = UP ? a.sorted_pairs[row0 + j] / a.topk : row0 + j;
      s = a.xs[size_t(src_row) * (K / 32) + k0 / 32 + kb];
    }
    sa_s[kb * M + j] = s;
  }
  __syncthreads();

  const __half* x_row[MT];  // fragment f: pair f * 8 + g's row (pairs past the tile: unused)
#pragma unroll
  for (int f = 0; f < MT; ++f) x_row[f] = x_s + min(f * kFrag + g, a.x_rows - 1) * stride;
  float acc[2][MT][4];
#pragma unroll
  for (int rt = 0; rt < 2; ++rt)
#pragma unroll
    for (int f = 0; f < MT; ++f)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[rt][f][i] = 0.f;

  for (int c = c_lo; c < c_hi; ++c) {
    issue(c + STAGES - 1);
    cp_async_wait<STAGES - 1>();
    __syncwarp();
    const unsigned char* st = ring + (c % STAGES) * kStageBytes;
    const uint32_t* sc = reinterpret_cast<const uint32_t*>(st + kWarpRows * kRowBytes);
    const uint32_t swr[2][2] = {{sc[g], sc[g + 8]}, {sc[16 + g], sc[24 + g]}};
#pragma unroll
    for (int bp = 0; bp < 4; bp += 2) {
      uint32_t d[2][4];
#pragma unroll
      for (int rt = 0; rt < 2; ++rt) {
        const int r = rt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
        const int seg = bp + (lane >> 4);
        dsv41::ldmatrix_x4(d[rt], st + r * kRowBytes + ((seg ^ ((r >> 1) & 3)) << 4));
      }
#pragma unroll
      for (int bb = 0; bb < 2; ++bb) {
        const int b = bp + bb, kb = c * 4 + b;
        uint4 q[MT];
        float2 sa[MT];
#pragma unroll
        for (int f = 0; f < MT; ++f) {
          q[f] = *reinterpret_cast<const uint4*>(x_row[f] + kb * 32 + 8 * t);
          sa[f] = *reinterpret_cast<const float2*>(sa_s + kb * M + f * kFrag + 2 * t);
        }
#pragma unroll
        for (int rt = 0; rt < 2; ++rt) {
          const uint32_t wg = d[rt][2 * bb], wg8 = d[rt][2 * bb + 1];
          const uint32_t w0 = e2m1_pair<0>(wg), w1 = e2m1_pair<0>(wg8), w2 = e2m1_pair<1>(wg), w3 = e2m1_pair<1>(wg8);
          const uint32_t w4 = e2m1_pair<2>(wg), w5 = e2m1_pair<2>(wg8), w6 = e2m1_pair<3>(wg), w7 = e2m1_pair<3>(wg8);
          const float sw0 = e8m0_x16384((swr[rt][0] >> (8 * b)) & 0xFFu);
          const float sw1 = e8m0_x16384((swr[rt][1] >> (8 * b)) & 0xFFu);
#pragma unroll
          for (int f = 0; f < MT; ++f) {
            float cc[4] = {0.f, 0.f, 0.f, 0.f};
            dsv41::mma_f16_16816(cc, w0, w1, w2, w3, q[f].x, q[f].y);
            dsv41::mma_f16_16816(cc, w4, w5, w6, w7, q[f].z, q[f].w);
            acc[rt][f][0] = fmaf(cc[0], __fmul_rn(sw0, sa[f].x), acc[rt][f][0]);
            acc[rt][f][1] = fmaf(cc[1], __fmul_rn(sw0, sa[f].y), acc[rt][f][1]);
            acc[rt][f][2] = fmaf(cc[2], __fmul_rn(sw1, sa[f].x), acc[rt][f][2]);
            acc[rt][f][3] = fmaf(cc[3], __fmul_rn(sw1, sa[f].y), acc[rt][f][3]);
          }
        }
      }
    }
    __syncwarp();  // every lane is done with this stage before it is refilled
  }
  cp_async_wait<0>();
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");

  // C fragment f: (row g, pairs f8 + 2t, f8 + 2t + 1), (row g + 8, the same pairs); partials [wk][pair][row]
  float* red_w = red + wk * M * rows_cta_w;
#pragma unroll
  for (int rt = 0; rt < 2; ++rt) {
    const int r = wn * kWarpRows + rt * 16 + g;
#pragma unroll
    for (int f = 0; f < MT; ++f) {
      const int j = f * kFrag + 2 * t;
      red_w[j * rows_cta_w + r] = acc[rt][f][0];
      red_w[(j + 1) * rows_cta_w + r] = acc[rt][f][1];
      red_w[j * rows_cta_w + r + 8] = acc[rt][f][2];
      red_w[(j + 1) * rows_cta_w + r + 8] = acc[rt][f][3];
    }
  }
  __syncthreads();
  const int outs = n_rows * rows_cta_w;
  for (int e = tid; e < outs; e += blockDim.x) {
    float s = red[e];
    for (int j = 1; j < a.warps_k; ++j) s = __fadd_rn(s, red[j * M * rows_cta_w + e]);
    red[e] = s;
  }
  cg::cluster_group cluster = cg::this_cluster();
  if (a.splits > 1) {
    cluster.sync();  // every CTA's K-range partial is in its shared memory
  } else {
    __syncthreads();
  }
  const int rank = a.splits > 1 ? int(cluster.block_rank()) : 0;
  auto total = [&](int e) {  // the CTA partials of element e summed in rank order
    if (a.splits == 1) return red[e];
    float s = cluster.map_shared_rank(red, 0)[e];
    for (int j = 1; j < a.splits; ++j) s = __fadd_rn(s, cluster.map_shared_rank(red, j)[e]);
    return s;
  };

  if (!UP) {
    for (int e = rank * blockDim.x + tid; e < outs; e += a.splits * blockDim.x) {
      const int j = e / rows_cta_w, lr = e % rows_cta_w;
      const int n = blockIdx.y * rows_cta_w + lr;
      if (n < N) a.out[size_t(a.sorted_pairs[row0 + j]) * N + n] = total(e);
    }
  } else {
    // One warp per (pair j, 32 outputs): lane i owns output q = qb * 32 + i of this CTA's warps_n * 16
    const int qblocks = a.warps_n / 2;
    const int nwarps = blockDim.x / 32;
    for (int u = rank * nwarps + warp; u < n_rows * qblocks; u += a.splits * nwarps) {
      const int j = u / qblocks, qb = u % qblocks;
      const int q = qb * 32 + lane;
      const int lr1 = (q >> 4) * kWarpRows + (q & 15);  // its W1 row in the partials; W3 is 16 rows later
      const int col = blockIdx.y * a.warps_n * 16 + q;   // h column
      if (blockIdx.y * a.warps_n * 16 + qb * 32 >= N) continue;  // the whole 32-block is past I (I % 32 == 0)
      const int row = row0 + j;                                  // sorted row
      float gv = __bfloat162float(__float2bfloat16_rn(total(j * rows_cta_w + lr1)));
      float uv = __bfloat162float(__float2bfloat16_rn(total(j * rows_cta_w + lr1 + 16)));
      if (a.limit > 0.f) {
        uv = fminf(fmaxf(uv, -a.limit), a.limit);
        gv = fminf(gv, a.limit);
      }
      const float hv = __fmul_rn(__fmul_rn(__fdiv_rn(gv, __fadd_rn(1.0f, expf(-gv))), uv),
                                 a.rw[a.sorted_pairs[row]]);
      const __nv_bfloat16 hb = __float2bfloat16_rn(hv);
      if (a.h_raw != nullptr) a.h_raw[size_t(row) * N + col] = hb;
      const float hf = __bfloat162float(hb);
      float amax = fabsf(hf);
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
      const uint32_t e = dsv41::act_scale_exp(amax);
      const float inv_s = __uint_as_float((254u - e) << 23);
      const uint16_t code = uint16_t(dsv41::e4m3_pair_f16(hf, 0.f, inv_s) & 0xFFFFu);
      reinterpret_cast<uint16_t*>(a.hq)[size_t(row) * N + (col & ~7) + perm8(col & 7)] = code;
      if (lane == 0) a.hs[size_t(row) * (N / 32) + col / 32] = __uint_as_float(e << 23);
    }
  }
  if (a.splits > 1) cluster.sync();  // no CTA leaves while another still reads its shared memory
}

template <bool UP, int STAGES, int MT>
cudaError_t launch(const MoeArgs& a, int tiles, size_t smem, bool pdl, cudaStream_t stream) {
  static uint64_t smem_set = 0;  // this instance's shared-memory opt-in, per device
  const int rows_out = a.warps_n * (UP ? 16 : 32);
  return dsv41::launch_ex(moe_fp4_kernel<UP, STAGES, MT>, &smem_set, kMaxSmem,
                          dim3(a.splits, (a.n_out + rows_out - 1) / rows_out, tiles), dim3(32 * a.warps_n * a.warps_k, 1, 1),
                          smem, stream, a.splits > 1 ? a.splits : 0, pdl, a);
}

}  // namespace

extern "C" {

// Shared memory bytes of one CTA (0 when the parameters are invalid); the Python wrapper checks the limit.
size_t dsv41_moe_fp4_smem(int kc, int x_rows, int warps_n, int warps_k, int stages) {
  if (kc <= 0 || kc % kChunk || x_rows < 1 || x_rows > kMaxM || warps_n < 1 || warps_k < 1 ||
      warps_n * warps_k > kMaxWarps || stages < 2)
    return 0;
  size_t a, b, c;
  return smem_layout(kc, x_rows, warps_n, warps_k, stages, &a, &b, &c);
}

// The router after the gate: part fp32 [splits, T, E] (the gate's split-K partials), bias fp32 [E] -> weights fp32
// [T, topk], ids int32 [T, topk] (route_kernel). E <= 1024, topk <= min(E, 32). Returns a cudaError_t.
int dsv41_moe_route(const void* part, const void* bias, void* weights, void* ids, int splits, int T, int E, int topk,
                    float route_scale, int norm, void* stream) {
  if (splits < 1 || T < 0 || E < 1 || E > kRouteMaxExperts || topk < 1 || topk > kRouteMaxTopk || topk > E ||
      (norm != 0 && norm != 1))
    return int(cudaErrorInvalidValue);
  if (T == 0) return 0;
  route_kernel<<<T, (E + 31) / 32 * 32, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const float*>(part), static_cast<const float*>(bias), static_cast<float*>(weights),
      static_cast<int*>(ids), splits, T, E, topk, route_scale, norm);
  return int(cudaGetLastError());
}

// x bf16 [rows, K] -> xq f16 [rows, K] (E4M3 codes, permuted order), xs f32 [rows, K/32]. K % 32 == 0.
int dsv41_moe_quant_rows(const void* x, void* xq, void* xs, int rows, int K, void* stream) {
  if (rows < 0 || K <= 0 || K % 32) return int(cudaErrorInvalidValue);
  if (rows == 0) return 0;
  const int n = rows * (K / 32);
  quant_rows_kernel<<<(n + 127) / 128, 128, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const __nv_bfloat16*>(x), static_cast<__half*>(xq), static_cast<float*>(xs), rows, K);
  return int(cudaGetLastError());
}

// The plan of ids int32 [R] (num_experts E, tiles of bm pairs, max_tiles = min(E, R) + R / bm) into sorted [R]
// and tiles [3, max_tiles] (expert, first sorted row, rows), and quant_rows of x bf16 [rows, K], in one launch.
int dsv41_moe_plan_quant(const void* ids, int R, int E, int bm, int max_tiles, void* sorted, void* tiles,
                         const void* x, void* xq, void* xs, int rows, int K, void* stream) {
  const size_t plan_smem = (size_t(4) * E + kPlanThreads) * sizeof(int);
  if (R < 0 || E < 1 || bm < 1 || max_tiles != min(E, R) + R / bm || rows < 0 || K <= 0 || K % 32 ||
      plan_smem > 48 * 1024)
    return int(cudaErrorInvalidValue);
  const int quant_blocks = (rows * (K / 32) + kPlanThreads - 1) / kPlanThreads;
  plan_quant_kernel<<<1 + quant_blocks, kPlanThreads, plan_smem, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const int*>(ids), R, E, bm, max_tiles, static_cast<int*>(sorted), static_cast<int*>(tiles),
      static_cast<const __nv_bfloat16*>(x), static_cast<__half*>(xq), static_cast<float*>(xs), rows, K);
  return int(cudaGetLastError());
}

// up (up != 0) or down over `tiles` plan tiles. Pointers as MoeArgs; kc = K elements per cluster rank
// (a multiple of 128; splits * kc >= K > (splits - 1) * kc). Returns a cudaError_t.
int dsv41_moe_fp4(int up, const void* w, const void* ws, const void* xq, const void* xs, const void* sorted_pairs,
                  const void* tile_e, const void* tile_start, const void* tile_rows, int tiles, const void* rw,
                  void* hq, void* hs, void* h_raw, void* out, int n_out, int K, int topk, float limit, int kc,
                  int x_rows, int warps_n, int warps_k, int splits, int stages, int pdl, void* stream) {
  const size_t smem = dsv41_moe_fp4_smem(kc, x_rows, warps_n, warps_k, stages);
  if (smem == 0 || smem > kMaxSmem || tiles < 0 || n_out <= 0 || n_out % 32 || K % kChunk || splits < 1 ||
      splits > kMaxSplits || (splits - 1) * kc >= K || splits * kc < K || (up && warps_n % 2))
    return int(cudaErrorInvalidValue);
  if (tiles == 0) return 0;
  MoeArgs a;
  a.w = static_cast<const uint8_t*>(w);
  a.ws = static_cast<const uint8_t*>(ws);
  a.xq = static_cast<const __half*>(xq);
  a.xs = static_cast<const float*>(xs);
  a.sorted_pairs = static_cast<const int*>(sorted_pairs);
  a.tile_e = static_cast<const int*>(tile_e);
  a.tile_start = static_cast<const int*>(tile_start);
  a.tile_rows = static_cast<const int*>(tile_rows);
  a.rw = static_cast<const float*>(rw);
  a.hq = static_cast<__half*>(hq);
  a.hs = static_cast<float*>(hs);
  a.h_raw = static_cast<__nv_bfloat16*>(h_raw);
  a.out = static_cast<float*>(out);
  a.n_out = n_out;
  a.K = K;
  a.topk = topk;
  a.limit = limit;
  a.kc = kc;
  a.x_rows = x_rows;
  a.warps_n = warps_n;
  a.warps_k = warps_k;
  a.splits = splits;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int mt = tile_m(x_rows) / kFrag;
#define DSV41_MOE_CASE(S, MT)                                                                      \
  if (stages == S && mt == MT) return int(up ? launch<true, S, MT>(a, tiles, smem, pdl != 0, s)    \
                                             : launch<false, S, MT>(a, tiles, smem, pdl != 0, s));
#define DSV41_MOE_STAGES(MT) \
  DSV41_MOE_CASE(2, MT) DSV41_MOE_CASE(3, MT) DSV41_MOE_CASE(4, MT) DSV41_MOE_CASE(6, MT) DSV41_MOE_CASE(8, MT)
  DSV41_MOE_STAGES(1) DSV41_MOE_STAGES(2) DSV41_MOE_STAGES(4)
#undef DSV41_MOE_STAGES
#undef DSV41_MOE_CASE
  return int(cudaErrorInvalidValue);
}

const char* dsv41_moe_fp4_error_string(int err) { return cudaGetErrorString(static_cast<cudaError_t>(err)); }

}  // extern "C"
