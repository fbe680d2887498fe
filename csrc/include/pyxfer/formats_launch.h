// The launch seam of the quantized-format kernels (csrc/kernels/formats_quantize.cu,
// formats_dequantize.cu, formats_swap_first_dims.cu): plain pointers, sizes and a stream in, the launch's
// cudaGetLastError() out. Layouts and rules: pyxfer/formats.h and docs/specs/quantized-formats.md.
// M = product of the leading dims, K = the last dim.
// NOTE: every launcher runs on the current device, which must hold all the pointers; outputs are
// written on `stream` only. Scale buffers must arrive zeroed: the kernels write the logical entries,
// never the padding. Sizes of 0 launch nothing. Nothing here synchronizes.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "pyxfer/formats.h"

namespace pyxfer {

// Element type of a high-precision tensor (quantize input, dequantize output).
enum class HighPrecision : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// FP8 block scaling, 1x128 (block_dim 1) or 128x128 (block_dim 2); any M, K (partial edge blocks).
// x: contiguous [M, K] of x_dtype, any alignment. A null rowwise_data skips the rowwise usage (its
// scale too), likewise columnwise. Scale buffers have the padded shapes of fmt::fp8_block_scale_shape.
// `max_finite` is the input dtype's largest finite value (an overflowing scale becomes it).
struct Fp8BlockQuantizeArgs {
  const void* x;
  int64_t m, k;
  HighPrecision x_dtype;
  int block_dim;
  fmt::Fp8Kind kind;
  bool pow2_scales;
  float amax_epsilon, max_finite;
  uint8_t* rowwise_data;         // [M, K]
  float* rowwise_scale_inv;      // 1-D [cdiv(K,128), rup(M,4)]; 2-D [cdiv(M,128), rup(cdiv(K,128),4)]
  uint8_t* columnwise_data;      // [K, M]
  float* columnwise_scale_inv;   // 1-D [cdiv(M,128), rup(K,4)]; 2-D [cdiv(K,128), rup(cdiv(M,128),4)]
};
cudaError_t launch_quantize_fp8_block(const Fp8BlockQuantizeArgs& args, cudaStream_t stream);

// out[M, K] (out_dtype) from rowwise data [M, K] or columnwise data [K, M] and their fp32 scales.
cudaError_t launch_dequantize_fp8_block(const uint8_t* data, const float* scale_inv, int64_t m, int64_t k,
                                        int block_dim, bool columnwise, fmt::Fp8Kind kind, HighPrecision out_dtype,
                                        void* out, cudaStream_t stream);

// MXFP8 (M % 32 == 0, K % 32 == 0). Both data buffers are [M, K] (columnwise is not transposed);
// compact E8M0 scales: rowwise [rup(M,128), rup(K/32,4)], columnwise [rup(M/32,4), rup(K,128)].
struct Mxfp8QuantizeArgs {
  const void* x;
  int64_t m, k;
  HighPrecision x_dtype;
  fmt::Fp8Kind kind;
  uint8_t* rowwise_data;
  uint8_t* rowwise_scale_inv;
  uint8_t* columnwise_data;
  uint8_t* columnwise_scale_inv;
};
cudaError_t launch_quantize_mxfp8(const Mxfp8QuantizeArgs& args, cudaStream_t stream);

cudaError_t launch_dequantize_mxfp8(const uint8_t* data, const uint8_t* scale_inv, int64_t m, int64_t k,
                                    bool columnwise, fmt::Fp8Kind kind, HighPrecision out_dtype, void* out,
                                    cudaStream_t stream);

// NVFP4 (M % 16 == 0, K % 16 == 0), global amax read from device memory (one fp32).
// rowwise data [M, K/2], scale [rup(M,128), rup(K/16,4)]; columnwise data [K, M/2], scale
// [rup(K,128), rup(M/16,4)]; E2M1 pairs with the even element in the low nibble.
struct Nvfp4QuantizeArgs {
  const void* x;
  int64_t m, k;
  HighPrecision x_dtype;
  const float* global_amax;
  uint8_t* rowwise_data;
  uint8_t* rowwise_scale_inv;
  uint8_t* columnwise_data;
  uint8_t* columnwise_scale_inv;
};
cudaError_t launch_quantize_nvfp4(const Nvfp4QuantizeArgs& args, cudaStream_t stream);

// out[M, K] from rowwise data [M, K/2] or columnwise data [K, M/2]; `amax` is one fp32 on the device.
cudaError_t launch_dequantize_nvfp4(const uint8_t* data, const uint8_t* scale_inv, const float* amax, int64_t m,
                                    int64_t k, bool columnwise, HighPrecision out_dtype, void* out,
                                    cudaStream_t stream);

// dst[b, a, :] = src[a, b, :] with rows of row_bytes bytes (src [A, B, row], dst [B, A, row]); any alignment.
cudaError_t launch_swap_first_dims(const void* src, void* dst, int64_t a_count, int64_t b_count, int64_t row_bytes,
                                   cudaStream_t stream);

}  // namespace pyxfer
