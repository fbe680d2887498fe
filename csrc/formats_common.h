// Argument checks and output allocation of the format ops, shared by the CPU implementations and the
// CUDA bindings so that both validate alike and allocate byte-identical layouts (torch-aware).
// Layouts: csrc/include/pyxfer/formats.h; contract: docs/specs/quantized-formats.md §2-§4.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <cstdint>
#include <utility>
#include <vector>

#include "checks.h"
#include "pyxfer/formats.h"

namespace pyxfer {

// The four buffers a quantize op returns; an unrequested usage is a 0-element tensor.
using QuantizedBuffers = std::array<at::Tensor, 4>;  // rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv

// The 2-D view every kernel works on: M = product of the leading dims, K = the last dim.
struct Matrix {
  int64_t m, k;
};

inline Matrix matrix_of(const at::Tensor& t) {
  int64_t m = 1;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) m *= t.size(d);
  return {m, t.dim() == 0 ? 1 : t.size(-1)};
}

inline void check_quantize_input(const char* op, const at::Tensor& x) {
  check_dense(op, "x", x);
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, op,
              ": x must be float32, bfloat16 or float16, got ", dtype);
  TORCH_CHECK(x.dim() >= 1, op, ": x must have at least 1 dimension, got a 0-dim tensor");
}

inline fmt::Fp8Kind fp8_kind_of(const char* op, at::ScalarType fp8_dtype) {
  TORCH_CHECK(fp8_dtype == at::kFloat8_e4m3fn || fp8_dtype == at::kFloat8_e5m2, op,
              ": fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got ", fp8_dtype);
  return fp8_dtype == at::kFloat8_e4m3fn ? fmt::kE4M3 : fmt::kE5M2;
}

inline float fp8_max_of(fmt::Fp8Kind kind) { return kind == fmt::kE4M3 ? fmt::kE4M3Max : fmt::kE5M2Max; }

// An overflowing FP8-block scale becomes the input dtype's max finite value (§2.3 step 4).
inline float max_finite_of(at::ScalarType dtype) {
  return dtype == at::kBFloat16 ? fmt::kBf16Max : (dtype == at::kHalf ? fmt::kHalfMax : fmt::kFloatMax);
}

inline void check_out_dtype(const char* op, at::ScalarType out_dtype) {
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16 || out_dtype == at::kHalf, op,
              ": out_dtype must be float32, bfloat16 or float16, got ", out_dtype);
}

inline void check_usages(const char* op, bool rowwise, bool columnwise) {
  TORCH_CHECK(rowwise || columnwise, op, ": at least one of rowwise and columnwise must be true");
}

// `what`: the argument the matrix comes from ("x"; for dequantize, the matrix that "data" stores).
inline void check_divisible(const char* op, const Matrix& mk, int64_t block, const char* format, const char* what) {
  TORCH_CHECK(mk.m % block == 0 && mk.k % block == 0, op, ": ", format, " needs the flattened leading dims (M=",
              mk.m, ") and the last dim (K=", mk.k, ") of ", what, " to be multiples of ", block);
}

inline at::Tensor bytes(const at::Tensor& like, at::IntArrayRef shape) {
  return at::empty(shape, like.options().dtype(at::kByte));
}

// A scale buffer: kernels write the used entries, the padding is zeroed here (most shapes have none;
// with whole buffers zeroed, FP8 1x128 quantize at 256 MiB took 108 us rowwise and 157 us both on an
// H200, against 105 and 152 without).
inline at::Tensor scale_buffer(const at::Tensor& like, fmt::ScaleShape s, at::ScalarType dtype) {
  at::Tensor t = at::empty({s.rows, s.cols}, like.options().dtype(dtype));
  if (s.used_rows < s.rows) t.narrow(0, s.used_rows, s.rows - s.used_rows).zero_();
  if (s.used_cols < s.cols) t.narrow(0, 0, s.used_rows).narrow(1, s.used_cols, s.cols - s.used_cols).zero_();
  return t;
}

inline at::Tensor nothing(const at::Tensor& like) { return at::empty({0}, like.options().dtype(at::kByte)); }

// (K, d0, ..., d_{n-2}): the shape of a transposed columnwise copy (FP8 block).
inline std::vector<int64_t> transposed_shape(const at::Tensor& x) {
  std::vector<int64_t> shape{x.size(-1)};
  for (int64_t d = 0; d + 1 < x.dim(); ++d) shape.push_back(x.size(d));
  return shape;
}

inline QuantizedBuffers alloc_fp8_block(const at::Tensor& x, int64_t block_dim, bool rowwise, bool columnwise) {
  const Matrix mk = matrix_of(x);
  const int dim = static_cast<int>(block_dim);
  return {rowwise ? bytes(x, x.sizes()) : nothing(x),
          rowwise ? scale_buffer(x, fmt::fp8_block_scale_shape(mk.m, mk.k, dim, false), at::kFloat) : nothing(x),
          columnwise ? bytes(x, transposed_shape(x)) : nothing(x),
          columnwise ? scale_buffer(x, fmt::fp8_block_scale_shape(mk.m, mk.k, dim, true), at::kFloat) : nothing(x)};
}

inline QuantizedBuffers alloc_mxfp8(const at::Tensor& x, bool rowwise, bool columnwise) {
  const Matrix mk = matrix_of(x);
  return {rowwise ? bytes(x, x.sizes()) : nothing(x),
          rowwise ? scale_buffer(x, fmt::mxfp8_scale_shape(mk.m, mk.k, false), at::kByte) : nothing(x),
          columnwise ? bytes(x, x.sizes()) : nothing(x),
          columnwise ? scale_buffer(x, fmt::mxfp8_scale_shape(mk.m, mk.k, true), at::kByte) : nothing(x)};
}

inline QuantizedBuffers alloc_nvfp4(const at::Tensor& x, bool rowwise, bool columnwise) {
  const Matrix mk = matrix_of(x);
  std::vector<int64_t> packed(x.sizes().begin(), x.sizes().end());
  packed.back() /= 2;  // two E2M1 values per byte
  return {rowwise ? bytes(x, packed) : nothing(x),
          rowwise ? scale_buffer(x, fmt::nvfp4_scale_shape(mk.m, mk.k, false), at::kByte) : nothing(x),
          columnwise ? bytes(x, {mk.k, mk.m / 2}) : nothing(x),
          columnwise ? scale_buffer(x, fmt::nvfp4_scale_shape(mk.m, mk.k, true), at::kByte) : nothing(x)};
}

// ---- dequantize: the stored data tells the logical matrix; the scale buffer must match it exactly.
inline void check_data(const char* op, const at::Tensor& data) {
  check_dense(op, "data", data);
  TORCH_CHECK(data.scalar_type() == at::kByte, op, ": data must be a uint8 tensor of raw bytes, got ",
              data.scalar_type());
  TORCH_CHECK(data.dim() >= 1, op, ": data must have at least 1 dimension, got a 0-dim tensor");
}

inline void check_scales(const char* op, const at::Tensor& scale_inv, at::ScalarType dtype, fmt::ScaleShape s) {
  check_dense(op, "scale_inv", scale_inv);
  TORCH_CHECK(scale_inv.scalar_type() == dtype && scale_inv.dim() == 2 && scale_inv.size(0) == s.rows &&
                  scale_inv.size(1) == s.cols,
              op, ": scale_inv must be ", dtype, " of shape [", s.rows, ", ", s.cols, "] for this data, got ",
              scale_inv.scalar_type(), " of shape ", scale_inv.sizes());
}

inline void check_same_device(const char* op, const char* arg, const at::Tensor& t, const at::Tensor& data) {
  TORCH_CHECK(t.device() == data.device(), op, ": ", arg, " must be on the device of data (", data.device(),
              "), got ", t.device());
}

// Logical (M, K) and result shape of stored data. FP8-block columnwise data is (K, d0, ..., d_{n-2}).
struct DequantShape {
  Matrix mk;
  std::vector<int64_t> out;
};

inline DequantShape fp8_block_dequant_shape(const at::Tensor& data, bool columnwise) {
  if (!columnwise) return {matrix_of(data), data.sizes().vec()};
  std::vector<int64_t> out(data.sizes().begin() + 1, data.sizes().end());
  int64_t m = 1;
  for (int64_t d : out) m *= d;
  out.push_back(data.size(0));
  return {{m, data.size(0)}, out};
}

inline DequantShape nvfp4_dequant_shape(const char* op, const at::Tensor& data, bool columnwise) {
  if (columnwise) {
    TORCH_CHECK(data.dim() == 2, op, ": columnwise NVFP4 data must be 2-D [K, M/2], got shape ", data.sizes());
    return {{data.size(1) * 2, data.size(0)}, {data.size(1) * 2, data.size(0)}};
  }
  std::vector<int64_t> out = data.sizes().vec();
  out.back() *= 2;
  const Matrix packed = matrix_of(data);
  return {{packed.m, packed.k * 2}, out};
}

inline void check_global_amax(const char* op, const char* arg, const at::Tensor& amax, const at::Tensor& like) {
  check_dense(op, arg, amax);
  TORCH_CHECK(amax.scalar_type() == at::kFloat && amax.numel() == 1, op, ": ", arg,
              " must be a float32 tensor with one element, got ", amax.scalar_type(), " with shape ", amax.sizes());
  check_same_device(op, arg, amax, like);
}

template <typename T>
T* ptr_or_null(const at::Tensor& t, bool wanted) { return wanted ? t.data_ptr<T>() : nullptr; }

// ---- every argument check of each op, in the order the CPU and CUDA implementations both run them.
struct QuantizeArgs {
  Matrix mk;
  fmt::Fp8Kind kind;
};

inline QuantizeArgs check_quantize_fp8_block(const char* op, const at::Tensor& x, int64_t block_dim, bool rowwise,
                                             bool columnwise, at::ScalarType fp8_dtype, double amax_epsilon) {
  check_quantize_input(op, x);
  check_usages(op, rowwise, columnwise);
  TORCH_CHECK(block_dim == 1 || block_dim == 2, op, ": block_dim must be 1 (1x128) or 2 (128x128), got ", block_dim);
  TORCH_CHECK(amax_epsilon >= 0.0, op, ": amax_epsilon must be >= 0, got ", amax_epsilon);
  return {matrix_of(x), fp8_kind_of(op, fp8_dtype)};
}

inline QuantizeArgs check_quantize_mxfp8(const char* op, const at::Tensor& x, bool rowwise, bool columnwise,
                                         at::ScalarType fp8_dtype) {
  check_quantize_input(op, x);
  check_usages(op, rowwise, columnwise);
  const fmt::Fp8Kind kind = fp8_kind_of(op, fp8_dtype);
  const Matrix mk = matrix_of(x);
  check_divisible(op, mk, fmt::kMxfp8BlockLen, "MXFP8", "x");
  return {mk, kind};
}

inline Matrix check_quantize_nvfp4(const char* op, const at::Tensor& x, const at::Tensor& global_amax, bool rowwise,
                                   bool columnwise) {
  check_quantize_input(op, x);
  check_usages(op, rowwise, columnwise);
  check_global_amax(op, "global_amax", global_amax, x);
  const Matrix mk = matrix_of(x);
  check_divisible(op, mk, fmt::kNvfp4BlockLen, "NVFP4", "x");
  return mk;
}

struct DequantizeArgs {
  DequantShape shape;
  fmt::Fp8Kind kind;  // FP8 formats only
};

inline DequantizeArgs check_dequantize_fp8_block(const char* op, const at::Tensor& data, const at::Tensor& scale_inv,
                                                 int64_t block_dim, bool columnwise, at::ScalarType fp8_dtype,
                                                 at::ScalarType out_dtype) {
  check_data(op, data);
  TORCH_CHECK(block_dim == 1 || block_dim == 2, op, ": block_dim must be 1 (1x128) or 2 (128x128), got ", block_dim);
  const fmt::Fp8Kind kind = fp8_kind_of(op, fp8_dtype);
  check_out_dtype(op, out_dtype);
  DequantShape shape = fp8_block_dequant_shape(data, columnwise);
  const Matrix mk = shape.mk;
  check_scales(op, scale_inv, at::kFloat,
               fmt::fp8_block_scale_shape(mk.m, mk.k, static_cast<int>(block_dim), columnwise));
  check_same_device(op, "scale_inv", scale_inv, data);
  return {std::move(shape), kind};
}

inline DequantizeArgs check_dequantize_mxfp8(const char* op, const at::Tensor& data, const at::Tensor& scale_inv,
                                             bool columnwise, at::ScalarType fp8_dtype, at::ScalarType out_dtype) {
  check_data(op, data);
  const fmt::Fp8Kind kind = fp8_kind_of(op, fp8_dtype);
  check_out_dtype(op, out_dtype);
  const Matrix mk = matrix_of(data);
  check_divisible(op, mk, fmt::kMxfp8BlockLen, "MXFP8", "the matrix data stores");
  check_scales(op, scale_inv, at::kByte, fmt::mxfp8_scale_shape(mk.m, mk.k, columnwise));
  check_same_device(op, "scale_inv", scale_inv, data);
  return {{mk, data.sizes().vec()}, kind};
}

inline DequantShape check_dequantize_nvfp4(const char* op, const at::Tensor& data, const at::Tensor& scale_inv,
                                           const at::Tensor& amax, bool columnwise, at::ScalarType out_dtype) {
  check_data(op, data);
  check_out_dtype(op, out_dtype);
  check_global_amax(op, "amax", amax, data);
  DequantShape shape = nvfp4_dequant_shape(op, data, columnwise);
  check_divisible(op, shape.mk, fmt::kNvfp4BlockLen, "NVFP4", "the matrix data stores");
  check_scales(op, scale_inv, at::kByte, fmt::nvfp4_scale_shape(shape.mk.m, shape.mk.k, columnwise));
  check_same_device(op, "scale_inv", scale_inv, data);
  return shape;
}

inline void check_swap_input(const char* op, const at::Tensor& src) {
  check_dense(op, "src", src);
  TORCH_CHECK(src.dim() >= 2, op, ": src must have at least 2 dimensions, got shape ", src.sizes());
}

inline std::vector<int64_t> swapped_shape(const at::Tensor& src) {
  std::vector<int64_t> shape = src.sizes().vec();
  std::swap(shape[0], shape[1]);
  return shape;
}

}  // namespace pyxfer
