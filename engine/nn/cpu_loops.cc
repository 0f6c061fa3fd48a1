// Vector loops of our own beside oneDNN's primitives (engine/nn/onednn.py builds them into one library with
// onednn.cc): attention's softmax rows, and two XLA FFI handlers where XLA's bf16 elementwise passes are slowest,
// GroupNorm + SiLU (the ResNet blocks') and GEGLU's exact-GELU gate (the transformer blocks').
// GCC 12 warns of an uninitialised variable inside its own AVX-512 intrinsics (its bug 105593, fixed in 13).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <oneapi/dnnl/dnnl.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_loops.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_sd {

// One chunk of keys of each row of logits [rows, m] -> bf16 weights exp((x - top) * scale), against each row's
// maximum so far (`tops`, -inf before the first chunk, updated); `rescale[r]` says what the row's earlier weights and
// their sum must be multiplied by, the maximum having grown (0 at the first chunk), and `sums` takes the chunk's.
void softmax_rows_plain(const float* logits, uint16_t* weights, float* tops, float* sums, float* rescale, int64_t rows,
                        int64_t m, float scale) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = logits + r * m;
    float top = tops[r];
    for (int64_t j = 0; j < m; ++j) top = std::max(top, row[j]);
    float total = 0.f;
    for (int64_t j = 0; j < m; ++j) {
      const float e = std::exp((row[j] - top) * scale);
      total += e;
      weights[r * m + j] = to_bf16(e);
    }
    rescale[r] = std::exp((tops[r] - top) * scale);
    sums[r] = sums[r] * rescale[r] + total;
    tops[r] = top;
  }
}

// 2^((x - max) * scale * log2(e)) for shift = max * scale * log2(e), never below 2^-126.
__attribute__((target("avx512f"), always_inline)) inline __m512 exp2_of(__m512 x, __m512 log2e, __m512 shift) {
  const __m512 t = _mm512_max_ps(_mm512_fmsub_ps(x, log2e, shift), _mm512_set1_ps(-126.f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC), f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.013428175f), f, _mm512_set1_ps(0.052240074f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24128133f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6930447f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// softmax_rows_plain's work with AVX-512, 16 logits at a time (the last few of a row under a mask), two passes over each row: its
// maximum; then the exponentials, their sum and their bf16 rounding (AVX512-BF16's conversion, nearest even as
// to_bf16). exp(y) = 2^n * 2^f for y * log2(e) = n + f, f in [0, 1): 2^f from a degree-4 polynomial (relative
// error 3e-6, far below the weights' bf16 rounding), 2^n applied by scalef.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void softmax_rows_avx512(
    const float* logits, uint16_t* weights, float* tops, float* sums, float* rescale, int64_t rows, int64_t m,
    float scale) {
  const float log2e_scale = 1.44269504f * scale;
  const __m512 log2e = _mm512_set1_ps(log2e_scale);
  const __mmask16 last = __mmask16((1u << (m % 16)) - 1);
  const int64_t whole = m / 16 * 16;
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = logits + r * m;
    uint16_t* w = weights + r * m;
    // Four running maxima and two running sums, so that no loop waits on its own last instruction's latency.
    __m512 top16 = _mm512_set1_ps(tops[r]), top_b = top16, top_c = top16, top_d = top16;
    int64_t j = 0;
    for (; j + 64 <= whole; j += 64) {
      top16 = _mm512_max_ps(top16, _mm512_loadu_ps(row + j));
      top_b = _mm512_max_ps(top_b, _mm512_loadu_ps(row + j + 16));
      top_c = _mm512_max_ps(top_c, _mm512_loadu_ps(row + j + 32));
      top_d = _mm512_max_ps(top_d, _mm512_loadu_ps(row + j + 48));
    }
    for (; j < whole; j += 16) top16 = _mm512_max_ps(top16, _mm512_loadu_ps(row + j));
    top16 = _mm512_max_ps(_mm512_max_ps(top16, top_b), _mm512_max_ps(top_c, top_d));
    if (last) top16 = _mm512_mask_max_ps(top16, last, top16, _mm512_maskz_loadu_ps(last, row + whole));
    const float top = _mm512_reduce_max_ps(top16);
    const __m512 shift = _mm512_set1_ps(top * log2e_scale);
    __m512 total16 = _mm512_setzero_ps(), total_b = total16;
    for (j = 0; j + 32 <= whole; j += 32) {
      const __m512 e = exp2_of(_mm512_loadu_ps(row + j), log2e, shift);
      const __m512 f = exp2_of(_mm512_loadu_ps(row + j + 16), log2e, shift);
      total16 = _mm512_add_ps(total16, e);
      total_b = _mm512_add_ps(total_b, f);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + j), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + j + 16), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(f)));
    }
    for (; j < whole; j += 16) {
      const __m512 e = exp2_of(_mm512_loadu_ps(row + j), log2e, shift);
      total16 = _mm512_add_ps(total16, e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + j), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e)));
    }
    total16 = _mm512_add_ps(total16, total_b);
    if (last) {
      __m512 e = exp2_of(_mm512_maskz_loadu_ps(last, row + whole), log2e, shift);
      total16 = _mm512_mask_add_ps(total16, last, total16, e);
      _mm256_mask_storeu_epi16(w + whole, last, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e)));
    }
    rescale[r] = std::exp((tops[r] - top) * scale);
    sums[r] = sums[r] * rescale[r] + _mm512_reduce_add_ps(total16);
    tops[r] = top;
  }
}

void softmax_rows_f32_plain(float* logits, float* sums, int64_t rows, int64_t m, float scale) {
  for (int64_t r = 0; r < rows; ++r) {
    float* row = logits + r * m;
    float top = row[0];
    for (int64_t j = 1; j < m; ++j) top = std::max(top, row[j]);
    float total = 0.f;
    for (int64_t j = 0; j < m; ++j) total += row[j] = std::exp((row[j] - top) * scale);
    sums[r] = total;
  }
}

// exp2_of's work with AVX2 + FMA, 8 lanes: 2^n built in the exponent bits (n + 127) << 23, as AVX2 has no scalef;
// n >= -126 keeps that a normal float.
__attribute__((target("avx2,fma"), always_inline)) inline __m256 exp2_of_avx2(__m256 x, __m256 log2e, __m256 shift) {
  const __m256 t = _mm256_max_ps(_mm256_fmsub_ps(x, log2e, shift), _mm256_set1_ps(-126.f));
  const __m256 n = _mm256_floor_ps(t), f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(0.013428175f), f, _mm256_set1_ps(0.052240074f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.24128133f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.6930447f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

// softmax_rows_f32_plain's work with AVX2, 8 logits at a time (the last m % 8 of a row one by one, through the same
// polynomial), two passes over each row while it is in the cache: its maximum; then the exponentials written over
// the logits and their sum. For CPUs without AVX-512 (Zen 2/3, Intel Core): XLA's f32 softmax inside its query
// blocks costs as much as the two products around it.
__attribute__((target("avx2,fma"))) void softmax_rows_f32_avx2(float* logits, float* sums, int64_t rows, int64_t m,
                                                                 float scale) {
  const float log2e_scale = 1.44269504f * scale;
  const __m256 log2e = _mm256_set1_ps(log2e_scale);
  const int64_t whole = m / 8 * 8;
  for (int64_t r = 0; r < rows; ++r) {
    float* row = logits + r * m;
    __m256 top8 = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < whole; j += 8) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(row + j));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, top8);
    float top = lanes[0];
    for (int i = 1; i < 8; ++i) top = std::max(top, lanes[i]);
    for (int64_t j = whole; j < m; ++j) top = std::max(top, row[j]);
    const __m256 shift = _mm256_set1_ps(top * log2e_scale);
    __m256 total8 = _mm256_setzero_ps();
    for (int64_t j = 0; j < whole; j += 8) {
      const __m256 e = exp2_of_avx2(_mm256_loadu_ps(row + j), log2e, shift);
      total8 = _mm256_add_ps(total8, e);
      _mm256_storeu_ps(row + j, e);
    }
    _mm256_store_ps(lanes, total8);
    float total = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
    for (int64_t j = whole; j < m; ++j) {
      _mm256_store_ps(lanes, exp2_of_avx2(_mm256_set1_ps(row[j]), log2e, shift));
      total += row[j] = lanes[0];
    }
    sums[r] = total;
  }
}

// Whether oneDNN may use all of `isa` here: the CPU has it and ONEDNN_MAX_CPU_ISA lets it (oneDNN's ISA values are
// cumulative bit masks), so a capped machine measures the class it is capped to in these loops too.
bool isa_allowed(dnnl::cpu_isa isa) {
  const auto bits = static_cast<unsigned>(isa);
  return (static_cast<unsigned>(dnnl::get_effective_cpu_isa()) & bits) == bits;
}

bool f32_loops_avx2() {
  static const bool avx2 = isa_allowed(dnnl::cpu_isa::avx2);
  return avx2;
}

bool amx_allowed() {
  static const bool amx = isa_allowed(dnnl::cpu_isa::avx512_core_amx);
  return amx;
}

// The AVX2 loop on AVX-512 CPUs too: f32 attention is the path of CPUs without native bf16, and an AVX-512 one with
// bf16 runs its attention in bf16 (softmax_rows_avx512).
void softmax_rows_f32(float* logits, float* sums, int64_t rows, int64_t m, float scale) {
  if (f32_loops_avx2()) softmax_rows_f32_avx2(logits, sums, rows, m, scale);
  else softmax_rows_f32_plain(logits, sums, rows, m, scale);
}

int64_t key_panels_size(int64_t m, int64_t d) { return (m + kPanelKeys - 1) / kPanelKeys * kPanelKeys * d; }

void pack_key_panels(const float* k, int64_t stride, int64_t m, int64_t d, float* panels) {
  for (int64_t key0 = 0; key0 < m; key0 += kPanelKeys) {
    float* panel = panels + key0 * d;
    const int64_t keys = std::min(kPanelKeys, m - key0);
    for (int64_t c = 0; c < d; ++c) {
      for (int64_t j = 0; j < keys; ++j) panel[c * kPanelKeys + j] = k[(key0 + j) * stride + c];
      for (int64_t j = keys; j < kPanelKeys; ++j) panel[c * kPanelKeys + j] = 0.f;
    }
  }
}

// R query rows (R <= 6) against one panel of 16 keys: 2R accumulators of 8 lanes, one broadcast query value and two
// loads of the panel per step of the head's width, which keeps both FMA units busy at any width (oneDNN 3.2's f32
// gemm on AVX2 packs k^T again at every call and runs a width-64 product at half the rate of the weighted sum's
// width-4096 one). The first `keys` logits of each row are stored, the rest of a last panel under a mask.
template <int R>
__attribute__((target("avx2,fma"))) inline void logits_tile(const float* q, int64_t d, const float* panel,
                                                              float* out, int64_t m, int64_t keys) {
  __m256 lo[R], hi[R];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  for (int64_t c = 0; c < d; ++c) {
    const __m256 k_lo = _mm256_loadu_ps(panel + c * kPanelKeys), k_hi = _mm256_loadu_ps(panel + c * kPanelKeys + 8);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 x = _mm256_broadcast_ss(q + r * d + c);
      lo[r] = _mm256_fmadd_ps(x, k_lo, lo[r]);
      hi[r] = _mm256_fmadd_ps(x, k_hi, hi[r]);
    }
  }
  if (keys == kPanelKeys) {
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(out + r * m, lo[r]);
      _mm256_storeu_ps(out + r * m + 8, hi[r]);
    }
    return;
  }
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i mask_lo = _mm256_cmpgt_epi32(_mm256_set1_epi32(int(keys)), lane),
                mask_hi = _mm256_cmpgt_epi32(_mm256_set1_epi32(int(keys) - 8), lane);
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    _mm256_maskstore_ps(out + r * m, mask_lo, lo[r]);
    _mm256_maskstore_ps(out + r * m + 8, mask_hi, hi[r]);
  }
}

// Each panel in turn (4 KB at width 64, in L1) against every group of six rows (the block of queries stays in L2).
__attribute__((target("avx2,fma"))) void logits_f32(const float* q, int64_t rows, int64_t d, const float* panels,
                                                      int64_t m, float* logits) {
  for (int64_t key0 = 0; key0 < m; key0 += kPanelKeys) {
    const float* panel = panels + key0 * d;
    const int64_t keys = std::min(kPanelKeys, m - key0);
    int64_t r = 0;
    for (; r + 6 <= rows; r += 6) logits_tile<6>(q + r * d, d, panel, logits + r * m + key0, m, keys);
    float* out = logits + r * m + key0;
    switch (rows - r) {
      case 5: logits_tile<5>(q + r * d, d, panel, out, m, keys); break;
      case 4: logits_tile<4>(q + r * d, d, panel, out, m, keys); break;
      case 3: logits_tile<3>(q + r * d, d, panel, out, m, keys); break;
      case 2: logits_tile<2>(q + r * d, d, panel, out, m, keys); break;
      case 1: logits_tile<1>(q + r * d, d, panel, out, m, keys); break;
      default: break;
    }
  }
}

void softmax_rows(const float* logits, uint16_t* weights, float* tops, float* sums, float* rescale, int64_t rows,
                  int64_t m, float scale) {
  static const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
  if (avx512) softmax_rows_avx512(logits, weights, tops, sums, rescale, rows, m, scale);
  else softmax_rows_plain(logits, weights, tops, sums, rescale, rows, m, scale);
}

}  // namespace jax_sd

namespace {

using jax_sd::to_bf16;

// x[i] as f32, from bf16 or f32 data.
inline float load(const void* data, bool bf16, int64_t i) {
  if (!bf16) return static_cast<const float*>(data)[i];
  uint32_t bits = uint32_t(static_cast<const uint16_t*>(data)[i]) << 16;
  float value;
  std::memcpy(&value, &bits, 4);
  return value;
}

// GroupNorm over x [B, P, C] (bf16 or f32; P pixels, channels last) with f32 scale and bias [C], into out of x's
// shape and dtype, optionally followed by SiLU: the ResNet blocks' GroupNorm + SiLU in two passes over x instead of
// XLA's reduce, broadcast and elementwise passes over bf16. Per image, each channel's sums of x and x^2 are
// accumulated in double over the pixels (threads take pixel ranges), summed per group into the mean and the variance
// (E[x^2] - E[x]^2, clipped at 0, as layers.GroupNorm computes it), then y = x * a[c] + b[c] with
// a = scale * rsqrt(var + eps), b = bias - mean * a, and silu(y) = y / (1 + exp(-y)), rounded to x's dtype.
__attribute__((target_clones("avx512f", "default"))) void channel_sums(const void* x, bool bf16, int64_t p0,
                                                                        int64_t p1, int64_t c, double* sums,
                                                                        double* squares) {
  std::vector<float> s(c, 0.f), q(c, 0.f);
  constexpr int64_t kRun = 64;  // f32 runs of 64 pixels, summed into the doubles
  for (int64_t start = p0; start < p1; start += kRun) {
    const int64_t end = std::min(p1, start + kRun);
    for (int64_t p = start; p < end; ++p)
      for (int64_t j = 0; j < c; ++j) {
        const float v = load(x, bf16, p * c + j);
        s[j] += v;
        q[j] += v * v;
      }
    for (int64_t j = 0; j < c; ++j) {
      sums[j] += s[j], squares[j] += q[j];
      s[j] = 0.f, q[j] = 0.f;
    }
  }
}

__attribute__((target_clones("avx512f", "default"))) void scale_shift(const void* x, void* out, bool bf16, int64_t p0,
                                                                       int64_t p1, int64_t c, const float* a,
                                                                       const float* b, bool silu) {
  for (int64_t p = p0; p < p1; ++p)
    for (int64_t j = 0; j < c; ++j) {
      float y = load(x, bf16, p * c + j) * a[j] + b[j];
      if (silu) y = y / (1.f + std::exp(-y));
      if (bf16) static_cast<uint16_t*>(out)[p * c + j] = to_bf16(y);
      else static_cast<float*>(out)[p * c + j] = y;
    }
}

ffi::Error GroupNormImpl(ffi::AnyBuffer x, ffi::AnyBuffer scale, ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> out,
                         int64_t groups, float eps, bool silu) {
  const bool bf16 = x.element_type() == ffi::DataType::BF16;
  auto xd = x.dimensions();
  if ((!bf16 && x.element_type() != ffi::DataType::F32) || out->element_type() != x.element_type() ||
      scale.element_type() != ffi::DataType::F32 || bias.element_type() != ffi::DataType::F32 || xd.size() != 3)
    return ffi::Error::InvalidArgument("onednn_group_norm takes bf16 or f32 x [B, P, C] and f32 scale and bias");
  const int64_t b = xd[0], p = xd[1], c = xd[2];
  if (groups <= 0 || c % groups || int64_t(scale.element_count()) != c || int64_t(bias.element_count()) != c)
    return ffi::Error::InvalidArgument("onednn_group_norm: the channels must split into the groups evenly");
  const int64_t per_group = c / groups;
  const int64_t chunk = 256, chunks = (p + chunk - 1) / chunk;  // pixels a thread takes at once
  const auto* sc = static_cast<const float*>(scale.untyped_data());
  const auto* bi = static_cast<const float*>(bias.untyped_data());
  std::vector<double> sums(b * chunks * c, 0.0), squares(b * chunks * c, 0.0);
  std::vector<float> a(b * c), shift(b * c);
  const char* xp = static_cast<const char*>(x.untyped_data());
  char* op = static_cast<char*>(out->untyped_data());
  const int64_t item = bf16 ? 2 : 4;
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t task = 0; task < b * chunks; ++task) {
      const int64_t image = task / chunks, p0 = (task % chunks) * chunk, p1 = std::min(p, p0 + chunk);
      channel_sums(xp + image * p * c * item, bf16, p0, p1, c, &sums[task * c], &squares[task * c]);
    }
#pragma omp single
    for (int64_t image = 0; image < b; ++image)
      for (int64_t g = 0; g < groups; ++g) {
        double s = 0.0, q = 0.0;
        for (int64_t k = 0; k < chunks; ++k)
          for (int64_t j = g * per_group; j < (g + 1) * per_group; ++j)
            s += sums[(image * chunks + k) * c + j], q += squares[(image * chunks + k) * c + j];
        const double count = double(p * per_group), mean = s / count;
        const double var = std::max(q / count - mean * mean, 0.0);
        const float inv = float(1.0 / std::sqrt(var + double(eps)));
        for (int64_t j = g * per_group; j < (g + 1) * per_group; ++j) {
          a[image * c + j] = inv * sc[j];
          shift[image * c + j] = bi[j] - float(mean) * a[image * c + j];
        }
      }
#pragma omp for schedule(static)
    for (int64_t task = 0; task < b * chunks; ++task) {
      const int64_t image = task / chunks, p0 = (task % chunks) * chunk, p1 = std::min(p, p0 + chunk);
      scale_shift(xp + image * p * c * item, op + image * p * c * item, bf16, p0, p1, c, &a[image * c],
                  &shift[image * c], silu);
    }
  }
  return ffi::Error::Success();
}

// GEGLU's gate over y [M, 2N] (the projection's output: the hidden half, then the gate half; bf16 or f32) into
// out [M, N] of y's dtype: hidden * gelu(gate), the exact (erf) GELU as diffusers' GEGLU, in f32 and rounded once.
__attribute__((target_clones("avx512f", "default"))) void geglu_rows(const void* y, void* out, bool bf16, int64_t r0,
                                                                      int64_t r1, int64_t n) {
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t j = 0; j < n; ++j) {
      const float hidden = load(y, bf16, r * 2 * n + j), gate = load(y, bf16, r * 2 * n + n + j);
      const float value = hidden * 0.5f * gate * (1.f + std::erf(gate * 0.70710678118654752f));
      if (bf16) static_cast<uint16_t*>(out)[r * n + j] = to_bf16(value);
      else static_cast<float*>(out)[r * n + j] = value;
    }
}

ffi::Error GegluImpl(ffi::AnyBuffer y, ffi::Result<ffi::AnyBuffer> out) {
  const bool bf16 = y.element_type() == ffi::DataType::BF16;
  auto yd = y.dimensions();
  if ((!bf16 && y.element_type() != ffi::DataType::F32) || out->element_type() != y.element_type() ||
      yd.size() != 2 || yd[1] % 2)
    return ffi::Error::InvalidArgument("onednn_geglu takes bf16 or f32 y [M, 2N]");
  const int64_t m = yd[0], n = yd[1] / 2, chunk = 16;
#pragma omp parallel for schedule(static)
  for (int64_t r0 = 0; r0 < m; r0 += chunk) geglu_rows(y.untyped_data(), out->untyped_data(), bf16, r0, std::min(m, r0 + chunk), n);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(OnednnGroupNorm, GroupNormImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("groups")
                                  .Attr<float>("eps")
                                  .Attr<bool>("silu"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(OnednnGeglu, GegluImpl, ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>());
