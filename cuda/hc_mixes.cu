// mHC mixes at decode (engine/kernels/mhc_cuda.py): engine.kernels.mhc.hc_mixes's contract for hc = 4,
//
//   m = (x · fn^T) · rstd,  rstd = 1 / sqrt(mean(x^2) + norm_eps)           x bf16 [N, K = 4·D], fn fp32 [24, K]
//   pre = sigmoid(m[0:4] s0 + b) + eps,  post = 2 sigmoid(m[4:8] s1 + b),
//   comb = Sinkhorn(softmax_rows(m[8:24] s2 + b) + eps): columns, then iters - 1 rounds of rows then columns
//
// (engine.model.mhc.hc_split_sinkhorn in fp32). Why CUDA: the Triton kernel's last split-K program runs the
// Sinkhorn on [16, 8, 4] tiles behind a ticket hand-off, ~10 us per call for 2 MB of fn; the hand-off and the
// epilogue are a latency chain. Here:
//
// - Grid (splits, N): `splits` CTAs of 8 warps per token over K (K / splits columns each). Warp w owns fn rows
//   3w .. 3w + 2 (warp 0 also Σx²); a lane takes column quads lane, lane + 32, ...: one 8-byte x load and three
//   float4 fn loads per quad, in flight together.
// - Each lane accumulates its rows' dot products in fp32 FMAs; each warp reduces by an xor butterfly and writes
//   its rows' partials of the CTA to a workspace [N, splits, 25]; after a fence the CTA takes a
//   ticket, and the token's last CTA sums the partials in split order (deterministic), runs the epilogue and
//   resets the ticket (zero between launches: CUDA-graph replays reuse it). The error is ~20 fp32 roundings
//   of Σ|x||fn|, inside the tests' bound.
// - The epilogue runs in one warp's registers: lanes 0..3 pre, 4..7 post, 16..31 the 4 x 4 comb (rows are
//   aligned lane quads, columns xor 4 / 8).
// - One stream at a time per ticket buffer (the wrapper keeps one per device).
// - Programmatic dependent launch: x may be the predecessor's output.

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "common.cuh"

namespace {

constexpr int kHc = 4;
constexpr int kMix = (2 + kHc) * kHc;  // 24 projections
constexpr int kVals = kMix + 1;       // + Σx²
constexpr int kMaxSplits = 1024;
constexpr int kThreads = 256;  // 8 warps x 3 fn rows
constexpr int kWarps = kThreads / 32;
constexpr int kRowsPerWarp = kMix / kWarps;

struct MixArgs {
  const __nv_bfloat16* x;  // [N, K]
  const float* fn;         // [24, K]
  const float* scale;      // [3]
  const float* base;       // [24]
  float* pre;              // [N, 4]
  float* post;             // [N, 4]
  float* comb;             // [N, 4, 4]
  float* part;             // [N, splits, 25] workspace
  int* tickets;            // [N], zero between launches
  int K, iters;
  float hc_eps, norm_eps;
};

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = __fadd_rn(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
  return v;
}

__device__ __forceinline__ float sigmoid(float z) { return __fdiv_rn(1.f, __fadd_rn(1.f, expf(-z))); }

__global__ void __launch_bounds__(kThreads) hc_mixes_kernel(const MixArgs a) {
  __shared__ bool last;
  __shared__ float red[kWarps][32];
  const int split = blockIdx.x, splits = gridDim.x;
  const int n = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int quads = a.K / splits / 4, k0 = split * quads * 4;

  asm volatile("griddepcontrol.wait;" ::: "memory");  // x may be the predecessor's output

  // warp w: fn rows 3w .. 3w + 2 over the CTA's column quads lane, lane + 32, ...; warp 0 also Σx²
  float acc[kRowsPerWarp] = {}, xsq = 0.f;
  const __nv_bfloat16* xr = a.x + size_t(n) * a.K + k0;
  const float* fr = a.fn + size_t(kRowsPerWarp * warp) * a.K + k0;
  for (int q = lane; q < quads; q += 32) {
    float4 f[kRowsPerWarp];
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) f[r] = __ldg(reinterpret_cast<const float4*>(fr + size_t(r) * a.K + 4 * q));
    const uint2 xb = *reinterpret_cast<const uint2*>(xr + 4 * q);
    const float x0 = __uint_as_float(xb.x << 16), x1 = __uint_as_float(xb.x & 0xFFFF0000u);
    const float x2 = __uint_as_float(xb.y << 16), x3 = __uint_as_float(xb.y & 0xFFFF0000u);
    if (warp == 0) xsq = fmaf(x3, x3, fmaf(x2, x2, fmaf(x1, x1, fmaf(x0, x0, xsq))));
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r)
      acc[r] = fmaf(x3, f[r].w, fmaf(x2, f[r].z, fmaf(x1, f[r].y, fmaf(x0, f[r].x, acc[r]))));
  }
  float* part = a.part + size_t(n) * splits * kVals;
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const float v = warp_sum(acc[r]);
    if (lane == 0) part[split * kVals + kRowsPerWarp * warp + r] = v;
  }
  if (warp == 0) {
    const float v = warp_sum(xsq);
    if (lane == 0) part[split * kVals + kMix] = v;
  }
  if (lane == 0) __threadfence();  // the partials are visible device-wide before the ticket counts them
  __syncthreads();
  if (tid == 0) last = atomicAdd(a.tickets + n, 1) == splits - 1;
  __syncthreads();

  if (last) {  // uniform over the CTA
    __threadfence();  // the other CTAs' partials (fenced before their tickets) are visible
    // warp w sums splits w, w + 8, ... of value `lane` (4 loads in flight), then warp 0 sums the warps in order
    float pv = 0.f;
    if (lane < kVals) {
      for (int s0 = warp; s0 < splits; s0 += 4 * kWarps) {
        float t[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int s = s0 + kWarps * u;
          t[u] = s < splits ? __ldcg(part + s * kVals + lane) : 0.f;
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) pv = __fadd_rn(pv, t[u]);
      }
    }
    red[warp][lane] = pv;
    __syncthreads();
    if (warp != 0) return;  // (after the CTA's last barrier) warp 0 runs the epilogue
    if (lane == 0) a.tickets[n] = 0;  // every CTA of this token has taken its ticket
    // lane -> the value it takes: 0..7 pre / post (index = lane), 16..31 comb (index lane - 8), 8..15 Σx²
    const int idx = lane < 8 ? lane : lane >= 16 ? lane - 8 : kMix;
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) v = __fadd_rn(v, red[w][idx]);
    const float sq = __shfl_sync(0xFFFFFFFFu, v, 8);
    const float rstd = __fdiv_rn(1.f, __fsqrt_rn(__fadd_rn(__fdiv_rn(sq, float(a.K)), a.norm_eps)));
    const int group = lane < 4 ? 0 : lane < 8 ? 1 : 2;
    const float z = idx < kMix ? fmaf(__fmul_rn(v, rstd), a.scale[group], a.base[idx]) : 0.f;
    // comb rows: lanes 16 + 4i + j; row reductions over xor 1, 2; column reductions over xor 4, 8
    float mx = z;
    mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, 2));
    const float e = expf(z - mx);
    float rs = __fadd_rn(e, __shfl_xor_sync(0xFFFFFFFFu, e, 1));
    rs = __fadd_rn(rs, __shfl_xor_sync(0xFFFFFFFFu, rs, 2));
    float cmb = __fadd_rn(__fdiv_rn(e, rs), a.hc_eps);
    auto col_norm = [&](float c) {
      float s = __fadd_rn(c, __shfl_xor_sync(0xFFFFFFFFu, c, 4));
      s = __fadd_rn(s, __shfl_xor_sync(0xFFFFFFFFu, s, 8));
      return __fdiv_rn(c, __fadd_rn(s, a.hc_eps));
    };
    auto row_norm = [&](float c) {
      float s = __fadd_rn(c, __shfl_xor_sync(0xFFFFFFFFu, c, 1));
      s = __fadd_rn(s, __shfl_xor_sync(0xFFFFFFFFu, s, 2));
      return __fdiv_rn(c, __fadd_rn(s, a.hc_eps));
    };
    cmb = col_norm(cmb);
    for (int it = 1; it < a.iters; ++it) cmb = col_norm(row_norm(cmb));
    if (lane < 4) a.pre[n * kHc + lane] = __fadd_rn(sigmoid(z), a.hc_eps);
    else if (lane < 8) a.post[n * kHc + lane - 4] = __fmul_rn(2.f, sigmoid(z));
    else if (lane >= 16) a.comb[n * kHc * kHc + lane - 16] = cmb;
  }
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

}  // namespace

extern "C" {

// pre fp32 [N, 4], post fp32 [N, 4], comb fp32 [N, 4, 4] = the mHC mixes of x bf16 [N, K] (8-byte aligned) with
// fn fp32 [24, K] (16-byte aligned), scale fp32 [3], base fp32 [24]; K a multiple of 4 · splits; `splits`
// (1..1024) CTAs of `threads` (256) per token; part fp32 [N, splits, 25] a workspace and
// tickets int32 [N] zero (and zero again after the launch). N = 0 launches nothing. Returns a cudaError_t
// (cudaErrorInvalidValue for parameters outside the contract, before any CUDA call).
int dsv41_hc_mixes(const void* x, const void* fn, const void* scale, const void* base, void* pre, void* post,
                   void* comb, void* part, void* tickets, int N, int K, int iters, float hc_eps, float norm_eps,
                   int splits, int threads, int pdl, void* stream) {
  if (N < 0 || N > 65535 || K < 4 || splits < 1 || splits > kMaxSplits || K % (4 * splits) || iters < 1 ||
      threads != kThreads || (pdl != 0 && pdl != 1))
    return int(cudaErrorInvalidValue);
  if (reinterpret_cast<uintptr_t>(x) % 8 || reinterpret_cast<uintptr_t>(fn) % 16)
    return int(cudaErrorInvalidValue);
  if (N == 0) return 0;
  MixArgs a;
  a.x = static_cast<const __nv_bfloat16*>(x);
  a.fn = static_cast<const float*>(fn);
  a.scale = static_cast<const float*>(scale);
  a.base = static_cast<const float*>(base);
  a.pre = static_cast<float*>(pre);
  a.post = static_cast<float*>(post);
  a.comb = static_cast<float*>(comb);
  a.part = static_cast<float*>(part);
  a.tickets = static_cast<int*>(tickets);
  a.K = K;
  a.iters = iters;
  a.hc_eps = hc_eps;
  a.norm_eps = norm_eps;
  static uint64_t smem_set = 0;
  return int(dsv41::launch_ex(hc_mixes_kernel, &smem_set, 0, dim3(splits, N, 1), dim3(threads, 1, 1), 0,
                              static_cast<cudaStream_t>(stream), 0, pdl != 0, a));
}

const char* dsv41_hc_mixes_error_string(int err) { return cudaGetErrorString(static_cast<cudaError_t>(err)); }

}  // extern "C"
