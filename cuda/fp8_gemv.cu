// FP8 block-scaled GEMV for decode shapes (M = 1..8), grouped, in two activation modes:
//
//   y[m, g, n] = bf16( Σ_kb (Σ_{k in kb} qa[m, g, k] · qw[g·N + n, k]) · (sa[m, g, kb] · sw[(g·N + n)/32, kb]) )
//
// for G groups (x [M, G, K] bf16, w FP8 E4M3 [G·N, K], sw E8M0 [ceil(G·N/32), K/32], y [M, G, N] bf16; G = 1 is
// the plain GEMV, G > 1 needs N % 32 == 0 so that no scale block straddles two groups). With out_f32 y is fp32,
// the sum before its bf16 rounding (the partial of a row-parallel product, summed over the shards and rounded
// once by the caller). (qa, sa) per 32 along K:
// - act_quant mode (QUANT): DeepSeek's fp8_gemm semantics: E4M3 codes and UE8M0 power-of-two scales, computed
//   here bit for bit engine.quant.act_quant;
// - bf16-exact mode: no activation quantisation, y = bf16(Σ x·w) with x the bf16 activations and w = qw·sw the
//   exact FP8 weights. Each 32-block is staged in f16 as qa = x / sa with sa = 2^max(e - 15, -126), e =
//   floor(log2 amax) (amax = the block's max |x|; an all-zero block has sa = 1). Why this is exact:
//   * range: amax/sa < 2^16 and, amax being bf16 (8 significant bits), amax/sa <= (2 - 2^-7)·2^15 = 65280
//     <= 65504 = the f16 maximum (with the -126 floor, amax < 2^-111 and amax/sa < 2^15);
//   * precision: a bf16 value has 8 significant bits, so v = x/sa is exact in f16 when f16's quantum at |v|
//     is at most v's: always for f16 normals (|v| >= 2^-14: 11 bits), and for subnormals (quantum 2^-24) iff
//     |v| >= 2^-17. So every x with |x| >= 2^(e - 32), in particular every |x| >= amax·2^-32, is exact; a
//     smaller one is rounded to nearest on the 2^-24·sa grid: error <= 2^-25·sa = 2^(e - 40) <= amax·2^-40.
//     (The -126 floor keeps sa a normal fp32 for blocks of tiny or subnormal bf16 values; there every
//     nonzero bf16 (>= 2^-133) gives |v| >= 2^-7, exact.) x·(1/sa) is exact in fp32 (a power-of-two scaling
//     whose result, where it matters, is normal), so the f16 value is x/sa rounded once (RN, like torch).
//   Products of an f16 qa (<= 11 bits) and an E4M3 code (4 bits, exact in f16) are exact in fp32 (magnitudes
//   2^-33 .. 2^25): the inner loop is the act_quant mode's, unchanged.
// In both modes the block sums are exact products summed in fp32 and scaled per block in fp32 (sa·sw is an
// exact power of two for sw >= 2^-22, which quant_fp8_weight guarantees), accumulated in K order: the order
// of fp8_linear_ref.
//
// Why tensor cores here: at M = 8 a CUDA-core GEMV needs 8 fp32 FMAs per weight byte, ~32 T FMA/s at the HBM
// rate: the whole fp32 throughput of the H200. So each warp streams 16..32 weight rows with 8-byte loads and
// feeds them to mma.sync m16n8k16 (f16 in, f32 accumulate; the 8 tokens are the MMA's N, E4M3 values are
// exact in f16, products are exact) as a fast FMA unit; the f32 block partial is then scaled by sa·sw.
// Fragment trick: thread (g, t) of a warp loads the 8 bytes [8t, 8t + 8) of block kb of rows g and g + 8
// and the 8 f16 activations [8t, 8t + 8) of token g from shared memory: the MMA's logical k order is a
// permutation of the block's 32 positions that is the same for A and B, so no shuffles are needed.
//
// Launch: programmatic dependent launch (optional): the first weight loads are issued before waiting for the
// previous kernel (griddepcontrol.wait), so they overlap its tail; x is read and y written only after it.
// Work: CTA (split s, row tile, group g) owns rows_cta = warps_n · row_tiles · 16 rows of group g and a K range
// of kc = K/splits. Its warps_k warp columns split that range further. Reduction is deterministic: warps in
// warp-column order through shared memory, then the `splits` CTAs of a thread-block cluster (DSMEM) in rank
// order. Groups are the grid's z dimension: x row stride G·K, y row stride G·N, weight rows offset by g·N.
// Memory traffic: G·N·K weight bytes + G·N·K/1024 scale bytes + 2·M·G·K·(N / rows_cta) (x re-read per CTA,
// from L2) + 2·M·G·N output bytes. No global workspace, no atomics: CUDA-graph capturable, any stream.

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "common.cuh"

namespace cg = cooperative_groups;

namespace {

constexpr int kMaxM = 8;        // the MMA's N
constexpr int kMaxWarps = 8;    // per CTA
constexpr int kMaxSplits = 8;   // portable cluster size
constexpr int kMaxSmem = 200 * 1024;

__device__ __forceinline__ uint2 ldg_stream(const uint8_t* p) {
  uint2 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v2.u32 {%0, %1}, [%2];"
               : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}

using dsv41::x_stride;

// act_quant of one 32-block (bf16 in global memory) -> 32 E4M3 values as f16 in shared memory; returns sa.
__device__ __forceinline__ float quant_block(const __nv_bfloat16* src, __half* dst) {
  float v[32];
  dsv41::load_bf16x32(src, v);
  const uint32_t e = dsv41::act_scale_exp(dsv41::amax32(v));  // s = 2^ceil(log2 y), biased exponent
  const float inv_s = __uint_as_float((254u - e) << 23);        // 1/s exactly
  uint32_t out[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) out[i] = dsv41::e4m3_pair_f16(v[2 * i], v[2 * i + 1], inv_s);
  uint4* d4 = reinterpret_cast<uint4*>(dst);
#pragma unroll
  for (int i = 0; i < 4; ++i) d4[i] = make_uint4(out[4 * i], out[4 * i + 1], out[4 * i + 2], out[4 * i + 3]);
  return __uint_as_float(e << 23);
}

// bf16-exact staging of one 32-block (bf16 in global memory) -> x / sa as f16 in shared memory; returns sa =
// 2^max(floor(log2 amax) - 15, -126) (1 for an all-zero block). See the header for why this is exact.
__device__ __forceinline__ float stage_block_exact(const __nv_bfloat16* src, __half* dst) {
  float v[32];
  dsv41::load_bf16x32(src, v);
  const float amax = dsv41::amax32(v);
  const uint32_t ab = __float_as_uint(amax);
  // biased exponent of sa: (E - 127) - 15 + 127 = E - 15 for amax = 2^(E - 127)·1.f, floored at 1 (2^-126)
  const int eb = int(ab >> 23);  // amax >= 0: no sign bit
  const uint32_t sb = ab == 0 ? 127u : uint32_t(max(eb - 15, 1));
  const float inv_s = __uint_as_float((254u - sb) << 23);  // 1/sa exactly (biased 14..253: normal)
  uint32_t out[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const __half2 h = __floats2half2_rn(__fmul_rn(v[2 * i], inv_s), __fmul_rn(v[2 * i + 1], inv_s));
    out[i] = *reinterpret_cast<const uint32_t*>(&h);  // low half = element 2i
  }
  uint4* d4 = reinterpret_cast<uint4*>(dst);
#pragma unroll
  for (int i = 0; i < 4; ++i) d4[i] = make_uint4(out[4 * i], out[4 * i + 1], out[4 * i + 2], out[4 * i + 3]);
  return __uint_as_float(sb << 23);
}

// The CTA's K range of x into shared memory, by all its threads: kMaxM rows of f16 (rows past M zero), each
// 32-block act-quantised (QUANT) or bf16-exact staged, its scale at sa_s[block][row].
template <bool QUANT>
__device__ __forceinline__ void stage_x(const __nv_bfloat16* x, __half* x_s, float* sa_s, int M, size_t x_row,
                                        int k0, int kb_valid, int kbc, int stride) {
  for (int p = threadIdx.x; p < kMaxM * kbc; p += blockDim.x) {
    const int m = p / kbc, blk = p % kbc;
    __half* dst = x_s + m * stride + blk * 32;
    float s = 0.f;
    if (m < M && blk < kb_valid) {
      const __nv_bfloat16* src = x + size_t(m) * x_row + k0 + blk * 32;
      if constexpr (QUANT) {
        s = quant_block(src, dst);
      } else {
        s = stage_block_exact(src, dst);
      }
    } else {
      uint4* d4 = reinterpret_cast<uint4*>(dst);
#pragma unroll
      for (int i = 0; i < 4; ++i) d4[i] = make_uint4(0, 0, 0, 0);
    }
    sa_s[blk * kMaxM + m] = s;
  }
}

// y[i] = s: bf16 (rounded to nearest even) or, with out_f32, the fp32 value itself.
__device__ __forceinline__ void store_out(void* y, size_t i, float s, bool out_f32) {
  if (out_f32) {
    static_cast<float*>(y)[i] = s;
  } else {
    static_cast<__nv_bfloat16*>(y)[i] = __float2bfloat16_rn(s);
  }
}

// The epilogue of both forms: each warp's C fragments (row g, tokens 2t, 2t + 1; row g + 8, the same) through
// shared memory, summed in warp-column order, then (splits > 1) the cluster's CTAs summed in rank order through
// DSMEM; bf16 out, or the fp32 sums (out_f32).
template <int RT>
__device__ __forceinline__ void reduce_store(const float (&acc)[RT][4], float* red, void* __restrict__ y,
                                             int M, int N, int row0, int rows_cta, size_t y_row, int wn, int wk,
                                             int warps_k, int splits, int tid, bool out_f32) {
  const int lane = tid & 31, g = lane >> 2, t = lane & 3;
  float* red_w = red + wk * kMaxM * rows_cta;
#pragma unroll
  for (int rt = 0; rt < RT; ++rt) {
    const int r = wn * RT * 16 + rt * 16 + g;
    red_w[(2 * t) * rows_cta + r] = acc[rt][0];
    red_w[(2 * t + 1) * rows_cta + r] = acc[rt][1];
    red_w[(2 * t) * rows_cta + r + 8] = acc[rt][2];
    red_w[(2 * t + 1) * rows_cta + r + 8] = acc[rt][3];
  }
  __syncthreads();
  const int outs = M * rows_cta;  // [token][row] elements of this CTA that are stored
  for (int e = tid; e < outs; e += blockDim.x) {
    float s = red[e];
    for (int j = 1; j < warps_k; ++j) s = __fadd_rn(s, red[j * kMaxM * rows_cta + e]);
    if (splits == 1) {
      const int m = e / rows_cta, r = row0 + e % rows_cta;
      if (r < N) store_out(y, size_t(m) * y_row + r, s, out_f32);
    } else {
      red[e] = s;
    }
  }
  if (splits > 1) {
    cg::cluster_group cluster = cg::this_cluster();
    cluster.sync();  // every CTA's K-range partial is in its shared memory
    const int rank = int(cluster.block_rank());
    for (int e = rank * blockDim.x + tid; e < outs; e += splits * blockDim.x) {
      float s = cluster.map_shared_rank(red, 0)[e];
      for (int j = 1; j < splits; ++j) s = __fadd_rn(s, cluster.map_shared_rank(red, j)[e]);
      const int m = e / rows_cta, r = row0 + e % rows_cta;
      if (r < N) store_out(y, size_t(m) * y_row + r, s, out_f32);
    }
    cluster.sync();  // no CTA leaves while another still reads its shared memory
  }
}

// A CTA's share of the GEMV and the thread's place in it, for both forms. Group blockIdx.z: its weight rows
// [g·N, g·N + N) (scale rows from g·N/32: N % 32 == 0 when G > 1), x[m, g, :] at m·G·K + g·K, y[m, g, :] at
// m·G·N + g·N (G = 1: the plain GEMV, offsets 0; y's elements are bf16, or fp32 with out_f32). Split blockIdx.x:
// K columns [k0, k0 + kc), kb_valid blocks of them inside K. Warp (wn, wk): RT·16 rows from wrow, blocks [kb_lo, kb_hi) of the split. Shared memory: x_s
// [8][stride] f16, sa_s [kbc][8] x's block scales, red [warps_k][8][rows_cta] the epilogue's partials.
template <int RT>
struct Share {
  const __nv_bfloat16* x;
  const uint8_t* w;
  const uint8_t* ws_row;  // the warp's scale row, from the split's first block
  void* y;  // the group's first output: bf16, or fp32 with out_f32
  size_t x_row, y_row;
  int stride, kbc, rows_cta, k0, kb_valid, row0, tid, lane, warp, g, t, wn, wk, kb_lo, kb_hi, wrow;
  __half* x_s;
  float* sa_s;
  float* red;

  __device__ __forceinline__ Share(unsigned char* smem, const __nv_bfloat16* x_, const uint8_t* w_,
                                   const uint8_t* ws, void* y_, int N, int K, int groups, int kc,
                                   int warps_n, int warps_k, bool out_f32) {
    stride = x_stride(kc);
    kbc = kc / 32;
    rows_cta = warps_n * RT * 16;
    x_s = reinterpret_cast<__half*>(smem);
    sa_s = reinterpret_cast<float*>(smem + kMaxM * stride * 2);
    red = sa_s + kbc * kMaxM;
    const int grp = blockIdx.z;
    x_row = size_t(groups) * K;
    y_row = size_t(groups) * N;
    x = x_ + size_t(grp) * K;
    y = static_cast<char*>(y_) + size_t(grp) * N * (out_f32 ? sizeof(float) : sizeof(__nv_bfloat16));
    w = w_ + size_t(grp) * N * K;
    ws += size_t(grp) * (N / 32) * (K / 32);
    k0 = blockIdx.x * kc;
    kb_valid = min(kc, K - k0) / 32;
    row0 = blockIdx.y * rows_cta;
    tid = threadIdx.x;
    lane = tid & 31;
    warp = tid >> 5;
    g = lane >> 2;
    t = lane & 3;
    wn = warp % warps_n;
    wk = warp / warps_n;
    const int per = (kb_valid + warps_k - 1) / warps_k;
    kb_lo = min(wk * per, kb_valid);
    kb_hi = min(kb_lo + per, kb_valid);
    wrow = row0 + wn * RT * 16;
    ws_row = ws + size_t(min(wrow, N - 1) / 32) * (K / 32) + k0 / 32;
  }
};

// One 32-block of one 16-row tile, in both forms: w0 / w1 the 8 weight bytes 8t.. of rows g / g + 8, q the
// tokens' f16 x fragment, s0 / s1 the scales of tokens 2t / 2t + 1 (x's block scale times the weight's). Two
// m16n8k16 MMAs into a fresh accumulator, then scaled and added to acc (row g: tokens 2t, 2t + 1; row g + 8: the
// same).
__device__ __forceinline__ void block_mma(float (&acc)[4], uint2 w0, uint2 w1, uint4 q, float s0, float s1) {
  float c[4] = {0.f, 0.f, 0.f, 0.f};
  uint32_t a[4];
  // A regs: (row g, k 2t..), (row g + 8, k 2t..), (row g, k 2t + 8..), (row g + 8, k 2t + 8..)
  dsv41::e4m3x4_to_f16x4(w0.x, a[0], a[2]);
  dsv41::e4m3x4_to_f16x4(w1.x, a[1], a[3]);
  dsv41::mma_f16_16816(c, a[0], a[1], a[2], a[3], q.x, q.y);
  dsv41::e4m3x4_to_f16x4(w0.y, a[0], a[2]);
  dsv41::e4m3x4_to_f16x4(w1.y, a[1], a[3]);
  dsv41::mma_f16_16816(c, a[0], a[1], a[2], a[3], q.z, q.w);
  acc[0] = __fadd_rn(acc[0], __fmul_rn(c[0], s0));
  acc[1] = __fadd_rn(acc[1], __fmul_rn(c[1], s1));
  acc[2] = __fadd_rn(acc[2], __fmul_rn(c[2], s0));
  acc[3] = __fadd_rn(acc[3], __fmul_rn(c[3], s1));
}

template <int RT, int U, bool QUANT>
__global__ void __launch_bounds__(32 * kMaxWarps) fp8_gemv_kernel(
    const __nv_bfloat16* x, const uint8_t* __restrict__ w, const uint8_t* __restrict__ ws,
    void* __restrict__ y, int M, int N, int K, int groups, int kc, int warps_n, int warps_k, int splits,
    int out_f32) {
  extern __shared__ __align__(16) unsigned char smem[];
  const Share<RT> sh(smem, x, w, ws, y, N, K, groups, kc, warps_n, warps_k, out_f32 != 0);
  const uint8_t* wp[RT][2];
#pragma unroll
  for (int rt = 0; rt < RT; ++rt)
#pragma unroll
    for (int h = 0; h < 2; ++h)
      wp[rt][h] = sh.w + size_t(min(sh.wrow + rt * 16 + h * 8 + sh.g, N - 1)) * K + sh.k0 + 8 * sh.t;

  uint2 wr[U][RT][2];
  uint32_t swb[U];
  auto load = [&](int kb0) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (kb0 + u < sh.kb_hi) {
#pragma unroll
        for (int rt = 0; rt < RT; ++rt)
#pragma unroll
          for (int h = 0; h < 2; ++h) wr[u][rt][h] = ldg_stream(wp[rt][h] + (kb0 + u) * 32);
        swb[u] = __ldg(sh.ws_row + kb0 + u);
      }
    }
  };
  load(sh.kb_lo);  // the first weight bytes are in flight while x is quantised
  // Programmatic dependent launch: everything above reads only weights; x (the previous kernel's output)
  // is read, and y written, after the previous grid has completed (a no-op without the launch attribute).
  asm volatile("griddepcontrol.wait;" ::: "memory");  // (x is not __restrict__: no load moves above this)

  stage_x<QUANT>(sh.x, sh.x_s, sh.sa_s, M, sh.x_row, sh.k0, sh.kb_valid, sh.kbc, sh.stride);
  __syncthreads();

  float acc[RT][4] = {};
  for (int kb0 = sh.kb_lo; kb0 < sh.kb_hi; kb0 += U) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int kb = kb0 + u;
      if (kb < sh.kb_hi) {
        const uint4 q = *reinterpret_cast<const uint4*>(sh.x_s + sh.g * sh.stride + kb * 32 + 8 * sh.t);
        const float2 sa = *reinterpret_cast<const float2*>(sh.sa_s + kb * kMaxM + 2 * sh.t);
        const float sw = __uint_as_float(swb[u] << 23);
#pragma unroll
        for (int rt = 0; rt < RT; ++rt)
          block_mma(acc[rt], wr[u][rt][0], wr[u][rt][1], q, __fmul_rn(sa.x, sw), __fmul_rn(sa.y, sw));
      }
    }
    load(kb0 + U);
  }

  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");  // the next kernel may start its prologue
  reduce_store<RT>(acc, sh.red, sh.y, M, N, sh.row0, sh.rows_cta, sh.y_row, sh.wn, sh.wk, warps_k, splits, sh.tid,
                   out_f32 != 0);
}

using dsv41::cp_async_commit;
using dsv41::cp_async_wait;

// Ring form (fp8_gemv_ring_kernel): the same products, sums and order as fp8_gemv_kernel, with the weights staged
// through a per-warp shared-memory ring instead of registers. Each stage holds 4 blocks (128 bytes) of the warp's
// RT·16 rows, copied by cp.async (16 bytes a lane, L2::256B, rows XOR-swizzled by 16-byte chunk so that the
// fragment reads are conflict-free; blocks past the warp's K range zero-filled); STAGES - 1 stages are in flight
// while one is computed, so the bytes in flight no longer depend on registers or on the MMA phases. A thread reads
// the same 8 bytes per (row, block) that the register form loads (lds.64), so the results are bitwise equal.
constexpr int kRingBlocks = 4;                  // 32-blocks per ring stage
constexpr int kRingRowBytes = kRingBlocks * 32;  // 128

__host__ __device__ __forceinline__ size_t ring_offset(int kc, int warps_n, int warps_k, int row_tiles) {
  const size_t b = size_t(kMaxM) * x_stride(kc) * 2 + size_t(kc / 32) * kMaxM * 4 +
                   size_t(warps_k) * kMaxM * warps_n * row_tiles * 16 * 4;
  return (b + 127) / 128 * 128;
}

__device__ __forceinline__ void cp_async16_zfill(void* dst, const void* src, int src_bytes) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(src_bytes)
               : "memory");
}

template <int RT, int STAGES, bool QUANT>
__global__ void __launch_bounds__(32 * kMaxWarps) fp8_gemv_ring_kernel(
    const __nv_bfloat16* x, const uint8_t* __restrict__ w, const uint8_t* __restrict__ ws,
    void* __restrict__ y, int M, int N, int K, int groups, int kc, int warps_n, int warps_k, int splits,
    int out_f32) {
  constexpr int kRows = RT * 16;
  constexpr int kStageBytes = kRows * kRingRowBytes;
  extern __shared__ __align__(16) unsigned char smem[];
  const Share<RT> sh(smem, x, w, ws, y, N, K, groups, kc, warps_n, warps_k, out_f32 != 0);
  unsigned char* ring = smem + ring_offset(kc, warps_n, warps_k, RT) + size_t(sh.warp) * STAGES * kStageBytes;
  const int nch = (sh.kb_hi - sh.kb_lo + kRingBlocks - 1) / kRingBlocks;

  // Lane l copies 16-byte pieces l, l + 32, ... of a stage: piece p = row p / 8, chunk p % 8 (bytes 16·chunk of
  // the stage's 128 per row), stored at chunk (p % 8) ^ (row % 8).
  auto issue = [&](int c) {
    if (c < nch) {
      unsigned char* st = ring + (c % STAGES) * kStageBytes;
#pragma unroll
      for (int i = 0; i < kRows * 8 / 32; ++i) {
        const int p = sh.lane + 32 * i, r = p >> 3, ch = p & 7;
        const int kb = sh.kb_lo + c * kRingBlocks + (ch >> 1);
        const uint8_t* src = sh.w + size_t(min(sh.wrow + r, N - 1)) * K + sh.k0;
        const bool ok = kb < sh.kb_hi;
        cp_async16_zfill(st + r * kRingRowBytes + ((ch ^ (r & 7)) << 4), ok ? src + kb * 32 + (ch & 1) * 16 : src,
                         ok ? 16 : 0);
      }
    }
    cp_async_commit();  // (an empty group past the end keeps the wait count uniform)
  };
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) issue(s);
  uint32_t sw_next = sh.kb_lo < sh.kb_hi ? __ldg(sh.ws_row + sh.kb_lo) : 0u;  // the first scale line is in flight too

  asm volatile("griddepcontrol.wait;" ::: "memory");  // x is the previous kernel's output

  stage_x<QUANT>(sh.x, sh.x_s, sh.sa_s, M, sh.x_row, sh.k0, sh.kb_valid, sh.kbc, sh.stride);
  __syncthreads();

  float acc[RT][4] = {};
  for (int c = 0; c < nch; ++c) {
    issue(c + STAGES - 1);
    cp_async_wait<STAGES - 1>();
    __syncwarp();
    const unsigned char* st = ring + (c % STAGES) * kStageBytes;
#pragma unroll
    for (int b = 0; b < kRingBlocks; ++b) {
      const int kb = sh.kb_lo + c * kRingBlocks + b;
      if (kb < sh.kb_hi) {
        const uint32_t swb = sw_next;
        if (kb + 1 < sh.kb_hi) sw_next = __ldg(sh.ws_row + kb + 1);
        const uint4 q = *reinterpret_cast<const uint4*>(sh.x_s + sh.g * sh.stride + kb * 32 + 8 * sh.t);
        const float2 sa = *reinterpret_cast<const float2*>(sh.sa_s + kb * kMaxM + 2 * sh.t);
        const float sw = __uint_as_float(swb << 23);
        const int col = ((2 * b + (sh.t >> 1)) ^ sh.g) << 4 | (sh.t & 1) << 3;  // bytes 32b + 8t of rows ≡ g (mod 8)
#pragma unroll
        for (int rt = 0; rt < RT; ++rt)
          block_mma(acc[rt], *reinterpret_cast<const uint2*>(st + (rt * 16 + sh.g) * kRingRowBytes + col),
                    *reinterpret_cast<const uint2*>(st + (rt * 16 + 8 + sh.g) * kRingRowBytes + col), q,
                    __fmul_rn(sa.x, sw), __fmul_rn(sa.y, sw));
      }
    }
    __syncwarp();  // every lane is done with this stage before it is refilled
  }
  cp_async_wait<0>();

  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  reduce_store<RT>(acc, sh.red, sh.y, M, N, sh.row0, sh.rows_cta, sh.y_row, sh.wn, sh.wk, warps_k, splits, sh.tid,
                   out_f32 != 0);
}

template <int RT, int U, bool QUANT>
cudaError_t launch(const void* x, const void* w, const void* ws, void* y, int M, int N, int K, int groups,
                   int kc, int warps_n, int warps_k, int splits, int out_f32, bool pdl, size_t smem,
                   cudaStream_t stream) {
  static uint64_t smem_set = 0;  // this instance's shared-memory opt-in, per device
  const int rows_cta = warps_n * RT * 16;
  return dsv41::launch_ex(fp8_gemv_kernel<RT, U, QUANT>, &smem_set, kMaxSmem,
                          dim3(splits, (N + rows_cta - 1) / rows_cta, groups), dim3(32 * warps_n * warps_k, 1, 1),
                          smem, stream, splits > 1 ? splits : 0, pdl, static_cast<const __nv_bfloat16*>(x),
                          static_cast<const uint8_t*>(w), static_cast<const uint8_t*>(ws), y, M, N, K, groups, kc,
                          warps_n, warps_k, splits, out_f32);
}

template <int RT, int STAGES, bool QUANT>
cudaError_t launch_ring(const void* x, const void* w, const void* ws, void* y, int M, int N, int K, int groups,
                        int kc, int warps_n, int warps_k, int splits, int out_f32, bool pdl, size_t smem,
                        cudaStream_t stream) {
  static uint64_t smem_set = 0;
  const int rows_cta = warps_n * RT * 16;
  return dsv41::launch_ex(fp8_gemv_ring_kernel<RT, STAGES, QUANT>, &smem_set, kMaxSmem,
                          dim3(splits, (N + rows_cta - 1) / rows_cta, groups), dim3(32 * warps_n * warps_k, 1, 1),
                          smem, stream, splits > 1 ? splits : 0, pdl, static_cast<const __nv_bfloat16*>(x),
                          static_cast<const uint8_t*>(w), static_cast<const uint8_t*>(ws), y, M, N, K, groups, kc,
                          warps_n, warps_k, splits, out_f32);
}

// The K columns of each split (kc) of a launch inside both entry points' contract (smem: its shared memory,
// 0 for invalid launch parameters), else 0.
int split_columns(int M, int N, int K, int groups, int quant_x, int out_f32, int splits, size_t smem) {
  if (M < 1 || M > kMaxM || N < 1 || smem == 0 || smem > kMaxSmem) return 0;
  if (groups < 1 || groups > 65535 || (groups > 1 && N % 32 != 0) || (quant_x != 0 && quant_x != 1)) return 0;
  if (out_f32 != 0 && out_f32 != 1) return 0;
  const int kb = K / 32, kbc = (kb + splits - 1) / splits;
  return (kb + kbc - 1) / kbc == splits ? kbc * 32 : 0;
}

}  // namespace

extern "C" {

// Shared memory bytes of one CTA (0 when the parameters are invalid); the Python wrapper checks its limit.
size_t dsv41_fp8_gemv_smem(int K, int row_tiles, int warps_n, int warps_k, int splits) {
  if (K <= 0 || K % 32 || row_tiles < 1 || row_tiles > 2 || warps_n < 1 || warps_k < 1 ||
      warps_n * warps_k > kMaxWarps || splits < 1 || splits > kMaxSplits)
    return 0;
  const int kb = K / 32, kbc = (kb + splits - 1) / splits, kc = kbc * 32;
  return size_t(kMaxM) * x_stride(kc) * 2 + size_t(kbc) * kMaxM * 4 +
         size_t(warps_k) * kMaxM * warps_n * row_tiles * 16 * 4;
}

// y [M, G, N] bf16 = stage(x [M, G, K] bf16) @ dequant(w [G·N, K] e4m3, ws [ceil(G·N/32), K/32] e8m0)^T per
// group (see the header): quant_x != 0: act_quant(x) (E4M3, UE8M0 per 32); quant_x == 0: bf16-exact.
// out_f32 = 1: y is fp32, the same sums before their bf16 rounding (0 or 1).
// groups = G >= 1 (the grid's z dimension, <= 65535); G > 1 needs N % 32 == 0.
// splits must not exceed ceil(K/32 / ceil(K/32 / splits)) (every CTA of a cluster owns K columns).
// Returns a cudaError_t (cudaErrorInvalidValue for parameters outside the contract, before any CUDA call).
// pdl: launch with programmatic stream serialization (weight loads overlap the previous kernel's tail).
int dsv41_fp8_gemv_grouped(const void* x, const void* w, const void* ws, void* y, int M, int N, int K, int groups,
                           int quant_x, int out_f32, int row_tiles, int unroll, int warps_n, int warps_k, int splits,
                           int pdl, void* stream) {
  const size_t smem = dsv41_fp8_gemv_smem(K, row_tiles, warps_n, warps_k, splits);
  const int kc = split_columns(M, N, K, groups, quant_x, out_f32, splits, smem);
  if (kc == 0) return int(cudaErrorInvalidValue);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
#define DSV41_GEMV_CASE(RT, U)                                                                                \
  if (row_tiles == RT && unroll == U)                                                                         \
    return int(quant_x ? launch<RT, U, true>(x, w, ws, y, M, N, K, groups, kc, warps_n, warps_k, splits,      \
                                             out_f32, pdl != 0, smem, s)                                      \
                       : launch<RT, U, false>(x, w, ws, y, M, N, K, groups, kc, warps_n, warps_k, splits,     \
                                              out_f32, pdl != 0, smem, s));
  DSV41_GEMV_CASE(1, 2) DSV41_GEMV_CASE(1, 4) DSV41_GEMV_CASE(1, 8)
  DSV41_GEMV_CASE(2, 2) DSV41_GEMV_CASE(2, 4) DSV41_GEMV_CASE(2, 8)
#undef DSV41_GEMV_CASE
  return int(cudaErrorInvalidValue);
}

// y [M, N] bf16 = act_quant(x [M, K] bf16) @ dequant(w [N, K] e4m3, ws [ceil(N/32), K/32] e8m0)^T: the grouped
// entry with G = 1 in act_quant mode (the same kernel instance and launch as before groups existed).
int dsv41_fp8_gemv(const void* x, const void* w, const void* ws, void* y, int M, int N, int K, int row_tiles,
                   int unroll, int warps_n, int warps_k, int splits, int pdl, void* stream) {
  return dsv41_fp8_gemv_grouped(x, w, ws, y, M, N, K, 1, 1, 0, row_tiles, unroll, warps_n, warps_k, splits, pdl,
                                stream);
}

// Shared memory bytes of one CTA of the ring form with `stages` stages (0 when the parameters are invalid).
size_t dsv41_fp8_gemv_ring_smem(int K, int row_tiles, int warps_n, int warps_k, int splits, int stages) {
  if (dsv41_fp8_gemv_smem(K, row_tiles, warps_n, warps_k, splits) == 0 || stages < 2 || stages > 4) return 0;
  const int kb = K / 32, kbc = (kb + splits - 1) / splits, kc = kbc * 32;
  return ring_offset(kc, warps_n, warps_k, row_tiles) +
         size_t(warps_n) * warps_k * stages * row_tiles * 16 * kRingRowBytes;
}

// dsv41_fp8_gemv_grouped's contract and results (bitwise), weights staged through the shared-memory ring
// (fp8_gemv_ring_kernel) with `stages` stages of 4 blocks (2..4).
int dsv41_fp8_gemv_ring(const void* x, const void* w, const void* ws, void* y, int M, int N, int K, int groups,
                        int quant_x, int out_f32, int row_tiles, int stages, int warps_n, int warps_k, int splits,
                        int pdl, void* stream) {
  const size_t smem = dsv41_fp8_gemv_ring_smem(K, row_tiles, warps_n, warps_k, splits, stages);
  const int kc = split_columns(M, N, K, groups, quant_x, out_f32, splits, smem);
  if (kc == 0) return int(cudaErrorInvalidValue);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
#define DSV41_RING_CASE(RT, S)                                                                                 \
  if (row_tiles == RT && stages == S)                                                                          \
    return int(quant_x ? launch_ring<RT, S, true>(x, w, ws, y, M, N, K, groups, kc, warps_n, warps_k, splits,  \
                                                  out_f32, pdl != 0, smem, s)                                  \
                       : launch_ring<RT, S, false>(x, w, ws, y, M, N, K, groups, kc, warps_n, warps_k, splits, \
                                                   out_f32, pdl != 0, smem, s));
  DSV41_RING_CASE(1, 2) DSV41_RING_CASE(1, 3) DSV41_RING_CASE(1, 4)
  DSV41_RING_CASE(2, 2) DSV41_RING_CASE(2, 3) DSV41_RING_CASE(2, 4)
#undef DSV41_RING_CASE
  return int(cudaErrorInvalidValue);
}

const char* dsv41_cuda_error_string(int err) { return cudaGetErrorString(static_cast<cudaError_t>(err)); }

}  // extern "C"
