// Quantize / dequantize on the CPU: the reference the CUDA kernels match bit for bit. Plain loops over
// the (M, K) matrix in fp32 using the shared rules in pyxfer/formats.h, rows split over threads.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstring>

#include "cpu/parallel.h"
#include "formats_common.h"

namespace pyxfer {
namespace {

using fmt::Fp8Kind;

constexpr int64_t kMinRowsPerThread = 64;

// x as a contiguous fp32 matrix (bf16 / fp16 widen exactly).
at::Tensor as_float(const at::Tensor& x) { return x.contiguous().to(at::kFloat); }

float block_amax(const float* x, int64_t count, int64_t stride) {
  float amax = 0.0f;
  for (int64_t i = 0; i < count; ++i) amax = fmt::max_f(amax, fmt::abs_f(x[i * stride]));
  return amax;
}

// ---- FP8 block scaling (§2.3). 1-D: scale_inv = 1/scale in double; 2-D: in fp32 (as TE's kernels).
struct Fp8BlockRule {
  Fp8Kind kind;
  float fp8_max, epsilon, max_finite;
  bool pow2;
  float scale(float amax) const { return fmt::fp8_block_scale(amax, fp8_max, pow2, epsilon, max_finite); }
};

void fp8_block_1d_rowwise(const float* x, Matrix mk, const Fp8BlockRule& rule, uint8_t* data, float* scale_inv,
                          int64_t scale_cols) {
  parallel_for(mk.m, kMinRowsPerThread, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t k0 = 0; k0 < mk.k; k0 += fmt::kFp8BlockLen) {
        const int64_t n = std::min<int64_t>(fmt::kFp8BlockLen, mk.k - k0);
        const float* row = x + m * mk.k + k0;
        const float scale = rule.scale(block_amax(row, n, 1));
        scale_inv[(k0 / fmt::kFp8BlockLen) * scale_cols + m] = static_cast<float>(1.0 / static_cast<double>(scale));
        for (int64_t j = 0; j < n; ++j) data[m * mk.k + k0 + j] = fmt::encode_fp8(fmt::mul_rn(row[j], scale), rule.kind);
      }
    }
  });
}

// Columnwise copy: data[k, m] (transposed), blocks of 128 along m, scale_inv[mb, k].
void fp8_block_1d_columnwise(const float* x, Matrix mk, const Fp8BlockRule& rule, uint8_t* data, float* scale_inv,
                             int64_t scale_cols) {
  const int64_t num_mb = fmt::cdiv(mk.m, fmt::kFp8BlockLen);
  parallel_for(num_mb, 1, [&](int64_t begin, int64_t end) {
    for (int64_t mb = begin; mb < end; ++mb) {
      const int64_t m0 = mb * fmt::kFp8BlockLen, n = std::min<int64_t>(fmt::kFp8BlockLen, mk.m - m0);
      for (int64_t k = 0; k < mk.k; ++k) {
        const float* column = x + m0 * mk.k + k;
        const float scale = rule.scale(block_amax(column, n, mk.k));
        scale_inv[mb * scale_cols + k] = static_cast<float>(1.0 / static_cast<double>(scale));
        for (int64_t i = 0; i < n; ++i) data[k * mk.m + m0 + i] = fmt::encode_fp8(fmt::mul_rn(column[i * mk.k], scale), rule.kind);
      }
    }
  });
}

// 128x128 tiles: one scale per tile in both scale buffers; columnwise data is the byte transpose.
void fp8_block_2d(const float* x, Matrix mk, const Fp8BlockRule& rule, uint8_t* row_data, float* row_scale,
                  int64_t row_scale_cols, uint8_t* col_data, float* col_scale, int64_t col_scale_cols) {
  const int64_t num_mb = fmt::cdiv(mk.m, fmt::kFp8BlockLen), num_kb = fmt::cdiv(mk.k, fmt::kFp8BlockLen);
  parallel_for(num_mb, 1, [&](int64_t begin, int64_t end) {
    for (int64_t mb = begin; mb < end; ++mb) {
      const int64_t m0 = mb * fmt::kFp8BlockLen, rows = std::min<int64_t>(fmt::kFp8BlockLen, mk.m - m0);
      for (int64_t kb = 0; kb < num_kb; ++kb) {
        const int64_t k0 = kb * fmt::kFp8BlockLen, cols = std::min<int64_t>(fmt::kFp8BlockLen, mk.k - k0);
        float amax = 0.0f;
        for (int64_t i = 0; i < rows; ++i) amax = fmt::max_f(amax, block_amax(x + (m0 + i) * mk.k + k0, cols, 1));
        const float scale = rule.scale(amax), inv = 1.0f / scale;
        if (row_scale) row_scale[mb * row_scale_cols + kb] = inv;
        if (col_scale) col_scale[kb * col_scale_cols + mb] = inv;
        for (int64_t i = 0; i < rows; ++i) {
          for (int64_t j = 0; j < cols; ++j) {
            const int64_t m = m0 + i, k = k0 + j;
            const uint8_t q = fmt::encode_fp8(fmt::mul_rn(x[m * mk.k + k], scale), rule.kind);
            if (row_data) row_data[m * mk.k + k] = q;
            if (col_data) col_data[k * mk.m + m] = q;
          }
        }
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_fp8_block_cpu(
    const at::Tensor& x, int64_t block_dim, bool rowwise, bool columnwise, at::ScalarType fp8_dtype, bool pow2_scales,
    double amax_epsilon) {
  const QuantizeArgs checked = check_quantize_fp8_block("pyxfer.quantize_fp8_block", x, block_dim, rowwise, columnwise,
                                                    fp8_dtype, amax_epsilon);
  const Matrix mk = checked.mk;
  const fmt::Fp8Kind kind = checked.kind;
  const Fp8BlockRule rule{kind, fp8_max_of(kind), static_cast<float>(amax_epsilon), max_finite_of(x.scalar_type()),
                          pow2_scales};
  QuantizedBuffers out = alloc_fp8_block(x, block_dim, rowwise, columnwise);
  const at::Tensor xf = as_float(x);
  const float* xp = xf.data_ptr<float>();
  if (block_dim == 1) {
    if (rowwise) fp8_block_1d_rowwise(xp, mk, rule, out[0].data_ptr<uint8_t>(), out[1].data_ptr<float>(), out[1].size(1));
    if (columnwise) fp8_block_1d_columnwise(xp, mk, rule, out[2].data_ptr<uint8_t>(), out[3].data_ptr<float>(), out[3].size(1));
  } else {
    fp8_block_2d(xp, mk, rule, ptr_or_null<uint8_t>(out[0], rowwise), ptr_or_null<float>(out[1], rowwise),
                 rowwise ? out[1].size(1) : 0, ptr_or_null<uint8_t>(out[2], columnwise),
                 ptr_or_null<float>(out[3], columnwise), columnwise ? out[3].size(1) : 0);
  }
  return {out[0], out[1], out[2], out[3]};
}

// ---- MXFP8 (§3.3): rowwise 1x32 blocks, scale[m, kb]; columnwise 32x1 blocks, scale[mb, k]; data not transposed.
void mxfp8_quantize(const float* x, Matrix mk, Fp8Kind kind, bool columnwise, uint8_t* data, uint8_t* scale,
                    int64_t scale_cols) {
  const float fp8_max = fp8_max_of(kind);
  const int64_t bl = fmt::kMxfp8BlockLen;
  const int64_t num_units = columnwise ? mk.m / bl : mk.m;  // 32-row groups or rows
  parallel_for(num_units, columnwise ? 1 : kMinRowsPerThread, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      for (int64_t c = 0; c < (columnwise ? mk.k : mk.k / bl); ++c) {
        // Block elements: columnwise -> x[u*32 + i, c] (stride K); rowwise -> x[u, c*32 + i] (stride 1).
        const int64_t first = columnwise ? u * bl * mk.k + c : u * mk.k + c * bl;
        const int64_t stride = columnwise ? mk.k : 1;
        const uint8_t e = fmt::mxfp8_scale(block_amax(x + first, bl, stride), fp8_max);
        scale[u * scale_cols + c] = e;
        const float multiplier = fmt::e8m0_reciprocal(e);
        for (int64_t i = 0; i < bl; ++i) {
          data[first + i * stride] = fmt::encode_fp8(fmt::mul_rn(x[first + i * stride], multiplier), kind);
        }
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_mxfp8_cpu(const at::Tensor& x, bool rowwise,
                                                                               bool columnwise, at::ScalarType fp8_dtype) {
  const QuantizeArgs checked = check_quantize_mxfp8("pyxfer.quantize_mxfp8", x, rowwise, columnwise, fp8_dtype);
  const Matrix mk = checked.mk;
  const fmt::Fp8Kind kind = checked.kind;
  QuantizedBuffers out = alloc_mxfp8(x, rowwise, columnwise);
  const at::Tensor xf = as_float(x);
  if (rowwise) mxfp8_quantize(xf.data_ptr<float>(), mk, kind, false, out[0].data_ptr<uint8_t>(), out[1].data_ptr<uint8_t>(), out[1].size(1));
  if (columnwise) mxfp8_quantize(xf.data_ptr<float>(), mk, kind, true, out[2].data_ptr<uint8_t>(), out[3].data_ptr<uint8_t>(), out[3].size(1));
  return {out[0], out[1], out[2], out[3]};
}

// ---- NVFP4 (§4.3): 16-element blocks, E4M3 block scales under the global amax, two E2M1 per byte
// (even element in the low nibble). Rowwise: data[m, k/2], scale[m, kb]. Columnwise (transposed):
// data[k, m/2], scale[k, mb].
void nvfp4_quantize(const float* x, Matrix mk, float global_amax, bool columnwise, uint8_t* data, uint8_t* scale,
                    int64_t scale_cols) {
  const float s_enc = fmt::nvfp4_encode_scale(global_amax);
  const float s_dec = static_cast<float>(1.0 / static_cast<double>(s_enc));
  const int64_t bl = fmt::kNvfp4BlockLen;
  const int64_t lines = columnwise ? mk.k : mk.m, length = columnwise ? mk.m : mk.k;  // blocks run along a line
  const int64_t stride = columnwise ? mk.k : 1;
  parallel_for(lines, kMinRowsPerThread, [&](int64_t begin, int64_t end) {
    for (int64_t line = begin; line < end; ++line) {
      const float* base = x + (columnwise ? line : line * mk.k);
      for (int64_t b = 0; b < length / bl; ++b) {
        const float* block = base + b * bl * stride;
        const fmt::Nvfp4Block s = fmt::nvfp4_block(block_amax(block, bl, stride), s_enc, s_dec);
        scale[line * scale_cols + b] = s.scale;
        for (int64_t i = 0; i < bl; i += 2) {
          const uint8_t lo = fmt::encode_e2m1(fmt::mul_rn(block[i * stride], s.multiplier));
          const uint8_t hi = fmt::encode_e2m1(fmt::mul_rn(block[(i + 1) * stride], s.multiplier));
          data[line * (length / 2) + (b * bl + i) / 2] = uint8_t(lo | (hi << 4));
        }
      }
    }
  });
}

float amax_value(const at::Tensor& amax) { return amax.to(at::kFloat).reshape({-1})[0].item<float>(); }

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_nvfp4_cpu(const at::Tensor& x,
                                                                               const at::Tensor& global_amax,
                                                                               bool rowwise, bool columnwise) {
  const Matrix mk = check_quantize_nvfp4("pyxfer.quantize_nvfp4", x, global_amax, rowwise, columnwise);
  QuantizedBuffers out = alloc_nvfp4(x, rowwise, columnwise);
  const at::Tensor xf = as_float(x);
  const float amax = amax_value(global_amax);
  if (rowwise) nvfp4_quantize(xf.data_ptr<float>(), mk, amax, false, out[0].data_ptr<uint8_t>(), out[1].data_ptr<uint8_t>(), out[1].size(1));
  if (columnwise) nvfp4_quantize(xf.data_ptr<float>(), mk, amax, true, out[2].data_ptr<uint8_t>(), out[3].data_ptr<uint8_t>(), out[3].size(1));
  return {out[0], out[1], out[2], out[3]};
}

// ---- dequantize: out[m, k] (fp32) = decoded element * its block's decode factor, then cast (RNE).
// `element(m, k)` returns the decoded value, `factor(m, k)` the decode factor of its block.
template <typename Element, typename Factor>
at::Tensor dequantize_matrix(const at::Tensor& like, const DequantShape& shape, at::ScalarType out_dtype,
                             const Element& element, const Factor& factor) {
  at::Tensor out = at::empty(shape.out, like.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  const Matrix mk = shape.mk;
  parallel_for(mk.m, kMinRowsPerThread, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      for (int64_t k = 0; k < mk.k; ++k) o[m * mk.k + k] = fmt::mul_rn(element(m, k), factor(m, k));
    }
  });
  return out.to(out_dtype);
}

at::Tensor dequantize_fp8_block_cpu(const at::Tensor& data, const at::Tensor& scale_inv, int64_t block_dim,
                                    bool columnwise, at::ScalarType fp8_dtype, at::ScalarType out_dtype) {
  const DequantizeArgs checked = check_dequantize_fp8_block("pyxfer.dequantize_fp8_block", data, scale_inv, block_dim,
                                                        columnwise, fp8_dtype, out_dtype);
  const DequantShape& shape = checked.shape;
  const fmt::Fp8Kind kind = checked.kind;
  const Matrix mk = shape.mk;
  const at::Tensor d = data.contiguous(), s = scale_inv.contiguous();
  const uint8_t* dp = d.data_ptr<uint8_t>();
  const float* sp = s.data_ptr<float>();
  const int64_t cols = s.size(1), bl = fmt::kFp8BlockLen;
  auto element = [&](int64_t m, int64_t k) {
    return fmt::decode_fp8(columnwise ? dp[k * mk.m + m] : dp[m * mk.k + k], kind);
  };
  auto factor = [&](int64_t m, int64_t k) {
    if (block_dim == 2) return columnwise ? sp[(k / bl) * cols + m / bl] : sp[(m / bl) * cols + k / bl];
    return columnwise ? sp[(m / bl) * cols + k] : sp[(k / bl) * cols + m];
  };
  return dequantize_matrix(data, shape, out_dtype, element, factor);
}

at::Tensor dequantize_mxfp8_cpu(const at::Tensor& data, const at::Tensor& scale_inv, bool columnwise,
                                at::ScalarType fp8_dtype, at::ScalarType out_dtype) {
  const DequantizeArgs checked = check_dequantize_mxfp8("pyxfer.dequantize_mxfp8", data, scale_inv, columnwise,
                                                    fp8_dtype, out_dtype);
  const DequantShape& shape = checked.shape;
  const fmt::Fp8Kind kind = checked.kind;
  const Matrix mk = shape.mk;
  const at::Tensor d = data.contiguous(), s = scale_inv.contiguous();
  const uint8_t* dp = d.data_ptr<uint8_t>();
  const uint8_t* sp = s.data_ptr<uint8_t>();
  const int64_t cols = s.size(1), bl = fmt::kMxfp8BlockLen;
  auto element = [&](int64_t m, int64_t k) { return fmt::decode_fp8(dp[m * mk.k + k], kind); };
  auto factor = [&](int64_t m, int64_t k) {
    return fmt::e8m0_value(columnwise ? sp[(m / bl) * cols + k] : sp[m * cols + k / bl]);
  };
  return dequantize_matrix(data, shape, out_dtype, element, factor);
}

at::Tensor dequantize_nvfp4_cpu(const at::Tensor& data, const at::Tensor& scale_inv, const at::Tensor& amax,
                                bool columnwise, at::ScalarType out_dtype) {
  const DequantShape shape =
      check_dequantize_nvfp4("pyxfer.dequantize_nvfp4", data, scale_inv, amax, columnwise, out_dtype);
  const Matrix mk = shape.mk;
  const at::Tensor d = data.contiguous(), s = scale_inv.contiguous();
  const uint8_t* dp = d.data_ptr<uint8_t>();
  const uint8_t* sp = s.data_ptr<uint8_t>();
  const int64_t cols = s.size(1), bl = fmt::kNvfp4BlockLen;
  const float global_amax = amax_value(amax);
  auto element = [&](int64_t m, int64_t k) {
    // Two values per byte, the even one in the low nibble; columnwise data is [k, m/2].
    const int64_t along = columnwise ? m : k;
    const uint8_t byte = columnwise ? dp[k * (mk.m / 2) + m / 2] : dp[m * (mk.k / 2) + k / 2];
    return fmt::decode_e2m1(uint8_t((along & 1) ? byte >> 4 : byte & 0xF));
  };
  auto factor = [&](int64_t m, int64_t k) {
    return fmt::nvfp4_decode_factor(columnwise ? sp[k * cols + m / bl] : sp[m * cols + k / bl], global_amax);
  };
  return dequantize_matrix(data, shape, out_dtype, element, factor);
}

// out[b, a, ...] = src[a, b, ...] (the gather fix-up of rank-major buffers).
at::Tensor swap_first_dims_cpu(const at::Tensor& src) {
  check_swap_input("pyxfer.swap_first_dims", src);
  const at::Tensor s = src.contiguous();
  at::Tensor out = at::empty(swapped_shape(s), s.options());
  const int64_t a_count = s.size(0), b_count = s.size(1);
  const int64_t row_bytes = a_count * b_count == 0 ? 0 : s.nbytes() / (a_count * b_count);
  const auto* in = static_cast<const uint8_t*>(s.data_ptr());
  auto* o = static_cast<uint8_t*>(out.data_ptr());
  parallel_for(a_count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t a = begin; a < end; ++a) {
      for (int64_t b = 0; b < b_count; ++b) {
        std::memcpy(o + (b * a_count + a) * row_bytes, in + (a * b_count + b) * row_bytes, row_bytes);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(pyxfer, CPU, m) {
  m.impl("quantize_fp8_block", &quantize_fp8_block_cpu);
  m.impl("dequantize_fp8_block", &dequantize_fp8_block_cpu);
  m.impl("quantize_mxfp8", &quantize_mxfp8_cpu);
  m.impl("dequantize_mxfp8", &dequantize_mxfp8_cpu);
  m.impl("quantize_nvfp4", &quantize_nvfp4_cpu);
  m.impl("dequantize_nvfp4", &dequantize_nvfp4_cpu);
  m.impl("swap_first_dims", &swap_first_dims_cpu);
}

}  // namespace pyxfer
