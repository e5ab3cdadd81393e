// bf16-weight GEMV with fp32 output for decode shapes (M = 1..8): the LM head and the other fp32 linears,
//
//   y[m, n] = fp32( Σ_k x[m, k] · w[n, k] )      x bf16 [M, K], w bf16 [N, K], y fp32 [M, N]
//
// the reference's `F.linear(x.float(), w.float())`: a product of two bf16 values (8-bit significands) is
// exact in fp32, so a bf16 x bf16 MMA with fp32 accumulation computes the same math; only the order of the
// fp32 additions differs. Streams the bf16 weight once (N·K·2 bytes) instead of an fp32 copy of it.
//
// Tensor cores as a fast FMA unit: at M = 8 a CUDA-core GEMV needs 4 fp32 FMAs per weight byte, most of the
// H200's fp32 throughput at the HBM rate. Each warp streams 16 · row_tiles weight rows with 16-byte loads
// and feeds them to mma.sync m16n8k16 bf16 -> f32 (weight rows on the MMA's M = 16, the 8 tokens on N = 8).
// Fragment trick: thread (g, t) of a warp loads the 16 bytes = 8 consecutive k [8t, 8t + 8) of a 32-column
// block of rows g and g + 8, and the same 8 k of token g from shared memory (x is staged there in natural
// order, the row stride padded so the 16-byte reads are bank-conflict free). Its 4 registers of each are
// two MMAs' worth: MMA 0 takes k pairs (8t, 8t+1) as logical k (2t, 2t+1) and (8t+2, 8t+3) as logical
// (2t+8, 2t+9); MMA 1 the pairs (8t+4, 8t+5), (8t+6, 8t+7). The logical k order is a permutation of the
// block's 32 columns that is the same for A and B, so no shuffles are needed.
// Summation: each 32-column block is summed by the two chained MMAs into a fresh fragment, which is then
// added to the thread's fp32 accumulator with a round-to-nearest add (the tensor core's own accumulation
// is not IEEE round-to-nearest; keeping its chains to 32 products keeps its error to the block's size).
//
// Launch: programmatic dependent launch (optional): the first weight loads are issued before waiting for the
// previous kernel (griddepcontrol.wait), so they overlap its tail; x is read and y written only after it.
// Work: CTA (split s, row tile) owns rows_cta = warps_n · row_tiles · 16 rows and a K range of kc = K/splits.
// Its warps_k warp columns split that range further. Each thread keeps `unroll` blocks of loads in flight
// and refills a block's registers as soon as it has consumed them. Reduction is deterministic: warps in
// warp-column order through shared memory, then the `splits` CTAs of a thread-block cluster (DSMEM) in rank
// order. Memory traffic: 2·N·K weight bytes + 2·M·K·(N / rows_cta) (x re-read per CTA, from L2) + 4·M·N
// output bytes. No global workspace, no atomics: CUDA-graph capturable, any stream.

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "common.cuh"

namespace cg = cooperative_groups;

namespace {

constexpr int kMaxM = 8;        // the MMA's N
constexpr int kMaxWarps = 8;    // per CTA
constexpr int kMaxSplits = 8;   // portable cluster size
constexpr int kMaxSmem = 200 * 1024;

__device__ __forceinline__ uint4 ldg_stream(const __nv_bfloat16* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

using dsv41::x_stride;

template <int RT, int U>
__global__ void __launch_bounds__(32 * kMaxWarps, 2) bf16_gemv_kernel(
    const __nv_bfloat16* x, const __nv_bfloat16* __restrict__ w, float* __restrict__ y, int M, int N, int K,
    int kc, int warps_n, int warps_k, int splits) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int stride = x_stride(kc);
  const int rows_cta = warps_n * RT * 16;
  __nv_bfloat16* x_s = reinterpret_cast<__nv_bfloat16*>(smem);           // [8][stride]
  float* red = reinterpret_cast<float*>(smem + kMaxM * stride * 2);       // [warps_k][8][rows_cta]

  const int split = blockIdx.x;
  const int k0 = split * kc;
  const int kb_valid = min(kc, K - k0) / 32;  // 32-column blocks of this CTA's K range
  const int row0 = blockIdx.y * rows_cta;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int wn = warp % warps_n, wk = warp / warps_n;
  const int per = (kb_valid + warps_k - 1) / warps_k;
  const int kb_lo = min(wk * per, kb_valid), kb_hi = min(kb_lo + per, kb_valid);
  const int wrow = row0 + wn * RT * 16;
  const __nv_bfloat16* wp[RT][2];  // rows g and g + 8 of each 16-row tile (clamped: rows past N are not stored)
#pragma unroll
  for (int rt = 0; rt < RT; ++rt)
#pragma unroll
    for (int h = 0; h < 2; ++h)
      wp[rt][h] = w + size_t(min(wrow + rt * 16 + h * 8 + g, N - 1)) * K + k0 + 8 * t;

  uint4 wr[U][RT][2];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (kb_lo + u < kb_hi) {
#pragma unroll
      for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int h = 0; h < 2; ++h) wr[u][rt][h] = ldg_stream(wp[rt][h] + (kb_lo + u) * 32);
    }
  }
  // Programmatic dependent launch: everything above reads only weights; x (the previous kernel's output)
  // is read, and y written, after the previous grid has completed (a no-op without the launch attribute).
  asm volatile("griddepcontrol.wait;" ::: "memory");  // (x is not __restrict__: no load moves above this)

  // Stage x[:, k0 : k0 + kc] in shared memory; token rows M..7 (the MMA's unused columns) are zeros.
  const int vecs = kc / 8;                 // 16-byte vectors per token row
  const int vecs_valid = kb_valid * 4;     // of them inside K
  const uint4 zero = make_uint4(0, 0, 0, 0);
  for (int p = tid; p < (kMaxM - M) * vecs; p += blockDim.x) {
    const int m = M + p / vecs, i = p % vecs;
    *reinterpret_cast<uint4*>(x_s + m * stride + 8 * i) = zero;
  }
  constexpr int kXBatch = 4;  // x loads in flight per thread
  for (int p0 = tid; p0 < M * vecs; p0 += kXBatch * blockDim.x) {
    uint4 v[kXBatch];
#pragma unroll
    for (int j = 0; j < kXBatch; ++j) {
      const int p = p0 + j * blockDim.x;
      const int m = p / vecs, i = p % vecs;
      v[j] = (p < M * vecs && i < vecs_valid)
                 ? *reinterpret_cast<const uint4*>(x + size_t(m) * K + k0 + 8 * i) : zero;
    }
#pragma unroll
    for (int j = 0; j < kXBatch; ++j) {
      const int p = p0 + j * blockDim.x;
      if (p < M * vecs) *reinterpret_cast<uint4*>(x_s + (p / vecs) * stride + 8 * (p % vecs)) = v[j];
    }
  }
  __syncthreads();

  float acc[RT][4];
#pragma unroll
  for (int rt = 0; rt < RT; ++rt)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[rt][i] = 0.f;

  const __nv_bfloat16* x_row = x_s + g * stride + 8 * t;  // token g, columns [8t, 8t + 8) of each block
  for (int kb0 = kb_lo; kb0 < kb_hi; kb0 += U) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int kb = kb0 + u;
      if (kb < kb_hi) {
        const uint4 q = *reinterpret_cast<const uint4*>(x_row + kb * 32);
#pragma unroll
        for (int rt = 0; rt < RT; ++rt) {
          const uint4 lo = wr[u][rt][0], hi = wr[u][rt][1];  // rows g, g + 8
          float c[4] = {0.f, 0.f, 0.f, 0.f};
          // A regs: (row g, k pair), (row g + 8, same pair), (row g, next pair), (row g + 8, next pair)
          dsv41::mma_bf16_16816(c, lo.x, hi.x, lo.y, hi.y, q.x, q.y);
          dsv41::mma_bf16_16816(c, lo.z, hi.z, lo.w, hi.w, q.z, q.w);
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[rt][i] = __fadd_rn(acc[rt][i], c[i]);
        }
        if (kb + U < kb_hi) {  // refill this slot at once: U blocks stay in flight
#pragma unroll
          for (int rt = 0; rt < RT; ++rt)
#pragma unroll
            for (int h = 0; h < 2; ++h) wr[u][rt][h] = ldg_stream(wp[rt][h] + (kb + U) * 32);
        }
      }
    }
  }

  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");  // the next kernel may start its prologue
  // C fragment: (row g, tokens 2t, 2t + 1), (row g + 8, tokens 2t, 2t + 1)
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
      if (r < N) y[size_t(m) * N + r] = s;
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
      if (r < N) y[size_t(m) * N + r] = s;
    }
    cluster.sync();  // no CTA leaves while another still reads its shared memory
  }
}

template <int RT, int U>
cudaError_t launch(const void* x, const void* w, void* y, int M, int N, int K, int kc, int warps_n, int warps_k,
                   int splits, bool pdl, size_t smem, cudaStream_t stream) {
  static uint64_t smem_set = 0;  // this instance's shared-memory opt-in, per device
  const int rows_cta = warps_n * RT * 16;
  return dsv41::launch_ex(bf16_gemv_kernel<RT, U>, &smem_set, kMaxSmem, dim3(splits, (N + rows_cta - 1) / rows_cta, 1),
                          dim3(32 * warps_n * warps_k, 1, 1), smem, stream, splits > 1 ? splits : 0, pdl,
                          static_cast<const __nv_bfloat16*>(x), static_cast<const __nv_bfloat16*>(w),
                          static_cast<float*>(y), M, N, K, kc, warps_n, warps_k, splits);
}

}  // namespace

extern "C" {

// Shared memory bytes of one CTA (0 when the parameters are invalid); the Python wrapper checks its limit.
size_t dsv41_bf16_gemv_smem(int K, int row_tiles, int warps_n, int warps_k, int splits) {
  if (K <= 0 || K % 32 || row_tiles < 1 || row_tiles > 2 || warps_n < 1 || warps_k < 1 ||
      warps_n * warps_k > kMaxWarps || splits < 1 || splits > kMaxSplits)
    return 0;
  const int kb = K / 32, kbc = (kb + splits - 1) / splits, kc = kbc * 32;
  return size_t(kMaxM) * x_stride(kc) * 2 + size_t(warps_k) * kMaxM * warps_n * row_tiles * 16 * 4;
}

// y [M, N] fp32 = x [M, K] bf16 @ w [N, K] bf16 ^T (fp32 accumulation).
// splits must not exceed ceil(K/32 / ceil(K/32 / splits)) (every CTA of a cluster owns K columns).
// Returns a cudaError_t (cudaErrorInvalidValue for parameters outside the contract, before any CUDA call).
// pdl: launch with programmatic stream serialization (weight loads overlap the previous kernel's tail).
int dsv41_bf16_gemv(const void* x, const void* w, void* y, int M, int N, int K, int row_tiles, int unroll,
                    int warps_n, int warps_k, int splits, int pdl, void* stream) {
  const size_t smem = dsv41_bf16_gemv_smem(K, row_tiles, warps_n, warps_k, splits);
  if (M < 1 || M > kMaxM || N < 1 || smem == 0 || smem > kMaxSmem) return int(cudaErrorInvalidValue);
  const int kb = K / 32, kbc = (kb + splits - 1) / splits;
  if ((kb + kbc - 1) / kbc != splits) return int(cudaErrorInvalidValue);
  const int kc = kbc * 32;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
#define DSV41_GEMV_CASE(RT, U)                                                                                \
  if (row_tiles == RT && unroll == U)                                                                         \
    return int(launch<RT, U>(x, w, y, M, N, K, kc, warps_n, warps_k, splits, pdl != 0, smem, s));
  DSV41_GEMV_CASE(1, 2) DSV41_GEMV_CASE(1, 4) DSV41_GEMV_CASE(1, 8)
  DSV41_GEMV_CASE(2, 2) DSV41_GEMV_CASE(2, 4)
#undef DSV41_GEMV_CASE
  return int(cudaErrorInvalidValue);
}

const char* dsv41_bf16_gemv_error_string(int err) { return cudaGetErrorString(static_cast<cudaError_t>(err)); }

}  // extern "C"
