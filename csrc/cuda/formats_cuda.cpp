// CUDA bindings of the quantized-format ops: validate (the checks the CPU implementations use) ->
// CUDAGuard on the data's device -> its current stream -> launch (csrc/kernels/formats_*.cu).
// Outputs are allocated by the shared helpers in formats_common.h, so layouts (and the zeroed scale
// padding) are byte-identical to the CPU reference.
// NOTE: c10/cuda headers only (not ATen/cuda/CUDAContext.h, which needs cuBLAS/cuSPARSE headers).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>

#include "formats_common.h"
#include "pyxfer/formats_launch.h"

namespace pyxfer {
namespace {

using Quantized = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

HighPrecision high_precision_of(at::ScalarType dtype) {
  return dtype == at::kBFloat16 ? HighPrecision::kBFloat16
                                : (dtype == at::kHalf ? HighPrecision::kFloat16 : HighPrecision::kFloat32);
}

Quantized quantize_fp8_block_cuda(const at::Tensor& x, int64_t block_dim, bool rowwise, bool columnwise,
                                  at::ScalarType fp8_dtype, bool pow2_scales, double amax_epsilon) {
  const QuantizeArgs checked = check_quantize_fp8_block("pyxfer.quantize_fp8_block", x, block_dim, rowwise, columnwise,
                                                    fp8_dtype, amax_epsilon);
  const Matrix mk = checked.mk;
  const fmt::Fp8Kind kind = checked.kind;
  const c10::cuda::CUDAGuard guard(x.device());
  QuantizedBuffers out = alloc_fp8_block(x, block_dim, rowwise, columnwise);
  if (x.numel() > 0) {
    const at::Tensor xc = x.contiguous();
    Fp8BlockQuantizeArgs args{};
    args.x = xc.data_ptr();
    args.m = mk.m;
    args.k = mk.k;
    args.x_dtype = high_precision_of(x.scalar_type());
    args.block_dim = static_cast<int>(block_dim);
    args.kind = kind;
    args.pow2_scales = pow2_scales;
    args.amax_epsilon = static_cast<float>(amax_epsilon);
    args.max_finite = max_finite_of(x.scalar_type());
    args.rowwise_data = ptr_or_null<uint8_t>(out[0], rowwise);
    args.rowwise_scale_inv = ptr_or_null<float>(out[1], rowwise);
    args.columnwise_data = ptr_or_null<uint8_t>(out[2], columnwise);
    args.columnwise_scale_inv = ptr_or_null<float>(out[3], columnwise);
    C10_CUDA_CHECK(launch_quantize_fp8_block(args, c10::cuda::getCurrentCUDAStream()));
  }
  return {out[0], out[1], out[2], out[3]};
}

at::Tensor dequantize_fp8_block_cuda(const at::Tensor& data, const at::Tensor& scale_inv, int64_t block_dim,
                                     bool columnwise, at::ScalarType fp8_dtype, at::ScalarType out_dtype) {
  const DequantizeArgs checked = check_dequantize_fp8_block("pyxfer.dequantize_fp8_block", data, scale_inv, block_dim,
                                                        columnwise, fp8_dtype, out_dtype);
  const DequantShape& shape = checked.shape;
  const fmt::Fp8Kind kind = checked.kind;
  const Matrix mk = shape.mk;
  const c10::cuda::CUDAGuard guard(data.device());
  at::Tensor out = at::empty(shape.out, data.options().dtype(out_dtype));
  if (out.numel() > 0) {
    const at::Tensor d = data.contiguous(), s = scale_inv.contiguous();
    C10_CUDA_CHECK(launch_dequantize_fp8_block(d.data_ptr<uint8_t>(), s.data_ptr<float>(), mk.m, mk.k,
                                               static_cast<int>(block_dim), columnwise, kind,
                                               high_precision_of(out_dtype), out.data_ptr(),
                                               c10::cuda::getCurrentCUDAStream()));
  }
  return out;
}

Quantized quantize_mxfp8_cuda(const at::Tensor& x, bool rowwise, bool columnwise, at::ScalarType fp8_dtype) {
  const QuantizeArgs checked = check_quantize_mxfp8("pyxfer.quantize_mxfp8", x, rowwise, columnwise, fp8_dtype);
  const Matrix mk = checked.mk;
  const fmt::Fp8Kind kind = checked.kind;
  const c10::cuda::CUDAGuard guard(x.device());
  QuantizedBuffers out = alloc_mxfp8(x, rowwise, columnwise);
  if (x.numel() > 0) {
    const at::Tensor xc = x.contiguous();
    Mxfp8QuantizeArgs args{};
    args.x = xc.data_ptr();
    args.m = mk.m;
    args.k = mk.k;
    args.x_dtype = high_precision_of(x.scalar_type());
    args.kind = kind;
    args.rowwise_data = ptr_or_null<uint8_t>(out[0], rowwise);
    args.rowwise_scale_inv = ptr_or_null<uint8_t>(out[1], rowwise);
    args.columnwise_data = ptr_or_null<uint8_t>(out[2], columnwise);
    args.columnwise_scale_inv = ptr_or_null<uint8_t>(out[3], columnwise);
    C10_CUDA_CHECK(launch_quantize_mxfp8(args, c10::cuda::getCurrentCUDAStream()));
  }
  return {out[0], out[1], out[2], out[3]};
}

at::Tensor dequantize_mxfp8_cuda(const at::Tensor& data, const at::Tensor& scale_inv, bool columnwise,
                                 at::ScalarType fp8_dtype, at::ScalarType out_dtype) {
  const DequantizeArgs checked = check_dequantize_mxfp8("pyxfer.dequantize_mxfp8", data, scale_inv, columnwise,
                                                    fp8_dtype, out_dtype);
  const DequantShape& shape = checked.shape;
  const fmt::Fp8Kind kind = checked.kind;
  const Matrix mk = shape.mk;
  const c10::cuda::CUDAGuard guard(data.device());
  at::Tensor out = at::empty(shape.out, data.options().dtype(out_dtype));
  if (out.numel() > 0) {
    const at::Tensor d = data.contiguous(), s = scale_inv.contiguous();
    C10_CUDA_CHECK(launch_dequantize_mxfp8(d.data_ptr<uint8_t>(), s.data_ptr<uint8_t>(), mk.m, mk.k, columnwise, kind,
                                           high_precision_of(out_dtype), out.data_ptr(),
                                           c10::cuda::getCurrentCUDAStream()));
  }
  return out;
}

Quantized quantize_nvfp4_cuda(const at::Tensor& x, const at::Tensor& global_amax, bool rowwise, bool columnwise) {
  const Matrix mk = check_quantize_nvfp4("pyxfer.quantize_nvfp4", x, global_amax, rowwise, columnwise);
  const c10::cuda::CUDAGuard guard(x.device());
  QuantizedBuffers out = alloc_nvfp4(x, rowwise, columnwise);
  if (x.numel() > 0) {
    const at::Tensor xc = x.contiguous(), amax = global_amax.contiguous();
    Nvfp4QuantizeArgs args{};
    args.x = xc.data_ptr();
    args.m = mk.m;
    args.k = mk.k;
    args.x_dtype = high_precision_of(x.scalar_type());
    args.global_amax = amax.data_ptr<float>();
    args.rowwise_data = ptr_or_null<uint8_t>(out[0], rowwise);
    args.rowwise_scale_inv = ptr_or_null<uint8_t>(out[1], rowwise);
    args.columnwise_data = ptr_or_null<uint8_t>(out[2], columnwise);
    args.columnwise_scale_inv = ptr_or_null<uint8_t>(out[3], columnwise);
    C10_CUDA_CHECK(launch_quantize_nvfp4(args, c10::cuda::getCurrentCUDAStream()));
  }
  return {out[0], out[1], out[2], out[3]};
}

at::Tensor dequantize_nvfp4_cuda(const at::Tensor& data, const at::Tensor& scale_inv, const at::Tensor& amax,
                                 bool columnwise, at::ScalarType out_dtype) {
  const DequantShape shape =
      check_dequantize_nvfp4("pyxfer.dequantize_nvfp4", data, scale_inv, amax, columnwise, out_dtype);
  const Matrix mk = shape.mk;
  const c10::cuda::CUDAGuard guard(data.device());
  at::Tensor out = at::empty(shape.out, data.options().dtype(out_dtype));
  if (out.numel() > 0) {
    const at::Tensor d = data.contiguous(), s = scale_inv.contiguous(), a = amax.contiguous();
    C10_CUDA_CHECK(launch_dequantize_nvfp4(d.data_ptr<uint8_t>(), s.data_ptr<uint8_t>(), a.data_ptr<float>(), mk.m,
                                           mk.k, columnwise, high_precision_of(out_dtype), out.data_ptr(),
                                           c10::cuda::getCurrentCUDAStream()));
  }
  return out;
}

// out[b, a, ...] = src[a, b, ...], any dtype (moved as bytes).
at::Tensor swap_first_dims_cuda(const at::Tensor& src) {
  check_swap_input("pyxfer.swap_first_dims", src);
  const c10::cuda::CUDAGuard guard(src.device());
  const at::Tensor s = src.contiguous();
  at::Tensor out = at::empty(swapped_shape(s), s.options());
  const int64_t a_count = s.size(0), b_count = s.size(1);
  if (out.numel() > 0) {
    const int64_t row_bytes = static_cast<int64_t>(s.nbytes()) / (a_count * b_count);
    C10_CUDA_CHECK(launch_swap_first_dims(s.data_ptr(), out.data_ptr(), a_count, b_count, row_bytes,
                                          c10::cuda::getCurrentCUDAStream()));
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(pyxfer, CUDA, m) {
  m.impl("quantize_fp8_block", &quantize_fp8_block_cuda);
  m.impl("dequantize_fp8_block", &dequantize_fp8_block_cuda);
  m.impl("quantize_mxfp8", &quantize_mxfp8_cuda);
  m.impl("dequantize_mxfp8", &dequantize_mxfp8_cuda);
  m.impl("quantize_nvfp4", &quantize_nvfp4_cuda);
  m.impl("dequantize_nvfp4", &dequantize_nvfp4_cuda);
  m.impl("swap_first_dims", &swap_first_dims_cuda);
}

}  // namespace pyxfer
