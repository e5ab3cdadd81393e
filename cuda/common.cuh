// What the CUDA kernels of cuda/*.cu share: act_quant of a 32-block (engine.quant.act_quant bit for bit), the f16
// and bf16 MMAs, ldmatrix, the E4M3 -> f16 and E2M1 -> f16 conversions, the permuted 8-group order, the activation
// row stride in shared memory, and the launch with the shared-memory opt-in, a thread-block cluster over x and
// programmatic dependent launch. engine/kernels/cuda_build.py hashes this header into every
// library's cache key.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace dsv41 {

// Activation rows in shared memory: kc f16 columns, padded by 64 bytes when the row is a multiple of 128 bytes
// (rows then start in alternating bank halves: conflict-free 16-byte loads of two rows at the same column).
__host__ __device__ __forceinline__ int x_stride(int kc) { return (kc % 64 == 0) ? kc + 32 : kc; }

// 32 bf16 values (16-byte aligned, global memory) -> fp32.
__device__ __forceinline__ void load_bf16x32(const __nv_bfloat16* src, float (&v)[32]) {
  const uint4* s4 = reinterpret_cast<const uint4*>(src);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint4 raw = s4[i];
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      v[8 * i + 2 * j] = __uint_as_float(w[j] << 16);
      v[8 * i + 2 * j + 1] = __uint_as_float(w[j] & 0xFFFF0000u);
    }
  }
}

__device__ __forceinline__ float amax32(const float (&v)[32]) {
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < 32; ++i) amax = fmaxf(amax, fabsf(v[i]));
  return amax;
}

// act_quant's scale of a block with maximum |v| amax: the biased exponent e of s = 2^ceil(log2(max(amax, 1e-4)
// / 448)); s = e << 23 and 1/s = (254 - e) << 23 as fp32 bits, both exact.
__device__ __forceinline__ uint32_t act_scale_exp(float amax) {
  amax = fmaxf(amax, 1e-4f);
  const uint32_t yb = __float_as_uint(__fmul_rn(amax, 1.0f / 448.0f));
  return ((yb >> 23) & 0xFF) + ((yb & 0x7FFFFF) != 0);
}

// (a / s, b / s) -> their E4M3 codes (saturating, round to nearest even) as an f16x2 (exact in f16), a low.
__device__ __forceinline__ uint32_t e4m3_pair_f16(float a, float b, float inv_s) {
  float2 q;
  q.x = fminf(fmaxf(__fmul_rn(a, inv_s), -448.f), 448.f);
  q.y = fminf(fmaxf(__fmul_rn(b, inv_s), -448.f), 448.f);
  const __nv_fp8x2_storage_t c = __nv_cvt_float2_to_fp8x2(q, __NV_SATFINITE, __NV_E4M3);
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(c, __NV_E4M3);
  return uint32_t(h.x) | (uint32_t(h.y) << 16);
}

// c += A · B: mma.sync m16n8k16, f16 operands, fp32 accumulation.
__device__ __forceinline__ void mma_f16_16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                              uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// c += A · B: mma.sync m16n8k16, bf16 operands, fp32 accumulation.
__device__ __forceinline__ void mma_bf16_16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                               uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// ldmatrix.x4 (optionally transposed): lane l gives the shared-memory row address of row l % 8 of matrix l / 8;
// thread (g, t) receives word t of row g of each of the four 8 x 16-byte matrices.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a) : "memory");
}

// 4 E4M3 bytes -> two f16x2 (exact): lo = (byte0, byte1), hi = (byte2, byte3), the low half from the low byte.
__device__ __forceinline__ void e4m3x4_to_f16x4(uint32_t w, uint32_t& lo, uint32_t& hi) {
  asm("{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, %2;\n\t"
      "cvt.rn.f16x2.e4m3x2 %0, l;\n\tcvt.rn.f16x2.e4m3x2 %1, h;\n\t}"
      : "=r"(lo), "=r"(hi) : "r"(w));
}

// 8 E2M1 nibbles (element i at bits 4i..4i+3) -> p[j] = f16x2 (element j, element j + 4), each value * 2^-14:
// sign bit to 15, the 3 exponent/mantissa bits to 11..9 (exponent 0 gives the f16 subnormal 2^-15 = 0.5 * 2^-14).
template <int J>
__device__ __forceinline__ uint32_t e2m1_pair(uint32_t w) {
  constexpr int kSign = 12 - 4 * J, kMag = 9 - 4 * J;
  const uint32_t s = (kSign >= 0 ? (w << kSign) : (w >> -kSign)) & 0x80008000u;
  const uint32_t m = (kMag >= 0 ? (w << kMag) : (w >> -kMag)) & 0x0E000E00u;
  return s | m;
}

// cp.async of 4 bytes (L1-allocating), and the commit / wait of cp.async groups.
__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(d), "l"(src) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// The position of element e (0..7) of an 8-group in the permuted activation order (the order in which e2m1_pair
// produces f16 pairs: stored [0, 4, 1, 5, 2, 6, 3, 7]).
__host__ __device__ __forceinline__ int perm8(int e) { return 2 * (e & 3) + (e >> 2); }

// Launch `kernel` on `stream` with dynamic shared memory `smem` (the kernel's opt-in to max_smem is set once per
// device in *smem_set, a static of the caller's kernel instance: the first call, a warm-up, is outside any graph
// capture), the cluster attribute with cluster_x CTAs along x when cluster_x >= 1 (0: no cluster attribute), and
// programmatic stream serialization when pdl. Returns the launch's cudaError_t.
template <typename... KernelArgs, typename... Args>
cudaError_t launch_ex(void (*kernel)(KernelArgs...), uint64_t* smem_set, int max_smem, dim3 grid, dim3 block,
                      size_t smem, cudaStream_t stream, int cluster_x, bool pdl, Args... args) {
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (device >= 64) return cudaErrorInvalidDevice;
  if (!(*smem_set >> device & 1)) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, max_smem);
    if (err != cudaSuccess) return err;
    *smem_set |= uint64_t(1) << device;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  unsigned num_attrs = 0;
  if (cluster_x >= 1) {
    attr[num_attrs].id = cudaLaunchAttributeClusterDimension;
    attr[num_attrs].val.clusterDim.x = cluster_x;
    attr[num_attrs].val.clusterDim.y = 1;
    attr[num_attrs].val.clusterDim.z = 1;
    ++num_attrs;
  }
  if (pdl) {
    attr[num_attrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[num_attrs].val.programmaticStreamSerializationAllowed = 1;
    ++num_attrs;
  }
  cfg.attrs = attr;
  cfg.numAttrs = num_attrs;
  return cudaLaunchKernelEx(&cfg, kernel, args...);
}

}  // namespace dsv41
