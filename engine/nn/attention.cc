// Attention as one XLA FFI handler (engine/nn/onednn.py): two products per block of queries around our own softmax
// (cpu_loops.cc), built into the same library as onednn.cc. In bf16 on AMX both products run on tiles of our own
// (attention_amx.cc, `amx_attention`); elsewhere the weighted sum is oneDNN's, and so are the logits in bf16, and in
// f32 where the CPU has no AVX2, while f32 with AVX2 takes our own logits kernel (cpu_loops.cc logits_f32).
#include <oneapi/dnnl/dnnl.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "attention_amx.h"
#include "cpu_loops.h"
#include "onednn.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using dnnl::memory;
using tag = dnnl::memory::format_tag;

namespace {

using namespace jax_sd;

// softmax(q k^T * scale) v over q [B, N, H, D], k and v [B, M, H, D] (all bf16, or all f32), out [B, N, H, D].
// Each (image, head)'s k and v are first reordered into the blocked layouts oneDNN's brgemm kernels read (once, not
// once per block of queries); then for each (image, head, block of queries) on a thread of its own: the block's
// queries copied into contiguous rows, the logits [rows, M] (single-threaded inside the parallel loop), the softmax
// over them while they are in the cache, the weights as bf16 (or in f32, over the logits themselves) into the second
// product, then each row divided by its sum. Nothing the size of all the logits is ever written. In f32 (CPUs
// without native bf16) this replaces XLA's query blocks, which copy k and v into their layout again for every
// block and run the softmax in passes of their own: SD 2.1's 4096-token self-attention on a Zen 3 core pair went
// from XLA's 2.8 s to 1.5 s (cores loaded by other work; nn/attention.py CPU_ONEDNN_F32_KEYS). Our own f32 logits
// took SD 2.1's 4096-token attention (5 heads of 64) from about 220 to 160 ms on a quiet Zen 3 core pair, and
// flushing denormals (FlushDenormals) keeps wide logits from costing 40% more (bench/kernels_f32.py's attention).
constexpr int64_t kAttentionRows = 256;

struct AttentionPrims {
  dnnl::matmul::primitive_desc logits_pd, out_pd;
  dnnl::matmul logits, out;
};

std::unordered_map<std::string, std::unique_ptr<AttentionPrims>> attentions;

// The two products for `rows` queries against `m` keys of width `d`, reading k^T and v in the layouts given (those
// oneDNN picks for a full block: a last, shorter block reads the same reordered copies).
// `dt`: q's, k's and v's type (bf16 or f32), which the weights take too.
AttentionPrims* attention_for(int64_t rows, int64_t m, int64_t d, memory::data_type dt, const memory::desc* k_layout,
                              const memory::desc* v_layout) {
  return cached(attentions, key_of({rows, m, d, k_layout != nullptr, int64_t(dt)}), [&] {
    auto f32 = memory::data_type::f32;
    memory::desc q({rows, d}, dt, tag::ab), logits({rows, m}, f32, tag::ab), weights({rows, m}, dt, tag::ab),
        out({rows, d}, f32, tag::ab);
    auto logits_pd = matmul_pd(q, k_layout ? *k_layout : memory::desc({d, m}, dt, tag::any), nullptr, logits);
    auto out_pd = matmul_pd(weights, v_layout ? *v_layout : memory::desc({m, d}, dt, tag::any), nullptr, out);
    return new AttentionPrims{logits_pd, out_pd, dnnl::matmul(logits_pd), dnnl::matmul(out_pd)};
  });
}

thread_local Buffer queries_buffer, logits_buffer, weights_buffer, out_buffer, total_buffer, keys_buffer;

// Whether a bf16 (or f32) array holds an inf or NaN (exponent bits all set): fast-math arithmetic cannot be trusted
// to carry them, so an image whose q, k or v holds one gets NaN out, as the plain formulation gives.
bool non_finite(const void* a, int64_t count, bool f32) {
  if (f32) {
    uint32_t any = 0;
    const uint32_t* bits = static_cast<const uint32_t*>(a);
    for (int64_t i = 0; i < count; ++i) any |= uint32_t((bits[i] & 0x7F800000u) == 0x7F800000u);
    return any != 0;
  }
  uint16_t any = 0;
  for (int64_t i = 0; i < count; ++i) any |= uint16_t((static_cast<const uint16_t*>(a)[i] & 0x7F80) == 0x7F80);
  return any != 0;
}

// Per image: whether its q, k or v holds an inf or NaN.
std::vector<char> broken_images(const char* qp, const char* kp, const char* vp, int64_t b, int64_t n, int64_t m,
                                int64_t hd, bool f32) {
  const int64_t size = f32 ? 4 : 2;
  std::vector<char> broken(b);
#pragma omp parallel for
  for (int64_t image = 0; image < b; ++image)
    broken[image] = non_finite(qp + image * n * hd * size, n * hd, f32) ||
                    non_finite(kp + image * m * hd * size, m * hd, f32) ||
                    non_finite(vp + image * m * hd * size, m * hd, f32);
  return broken;
}

// NaN into `rows` rows of one head's output, from `at` (elements), rows `stride` elements apart.
void fill_nan(void* op, bool bf16_out, int64_t at, int64_t rows, int64_t stride, int64_t d) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < d; ++c) {
      if (bf16_out) static_cast<uint16_t*>(op)[at + r * stride + c] = 0x7FC0;
      else static_cast<float*>(op)[at + r * stride + c] = std::numeric_limits<float>::quiet_NaN();
    }
}

// The keys a query may not see. Under `causal` (the text encoders' self-attention, as many keys as queries) query i
// sees keys 0..i; under a key mask (`key_mask` [B, M], true where a key may be attended: Z-Image's padded captions)
// the image's masked keys are seen by none. `hide` makes their logits -inf before the softmax, so that they count for
// nothing in a row's maximum; `zero` then makes their weights 0 (the softmax's exponentials stop at 2^-126, never 0;
// what they added to a row's sum is at most keys x 2^-126). Where an image's mask allows no key at all, `hide` makes
// every logit 0 instead and `zero` leaves them: uniform weights over all keys, which is what the plain formulation
// gives (every logit the same lowest number). Both take `rows` rows `stride` apart over `keys` keys, the first row
// query `first_query`, the first column key `first_key`.
struct Unseen {
  bool causal = false;
  const uint8_t* mask = nullptr;  // the image's [M], or null
  bool none_visible = false;      // its mask allows no key

  bool seen(int64_t query, int64_t key) const { return (!causal || key <= query) && (!mask || mask[key]); }

  void hide(float* logits, int64_t rows, int64_t stride, int64_t keys, int64_t first_query, int64_t first_key) const {
    if (!causal && !mask) return;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < keys; ++j)
        if (none_visible) logits[r * stride + j] = 0.f;
        else if (!seen(first_query + r, first_key + j))
          logits[r * stride + j] = -std::numeric_limits<float>::infinity();
  }

  template <typename T>
  void zero(T* weights, int64_t rows, int64_t stride, int64_t keys, int64_t first_query, int64_t first_key) const {
    if ((!causal && !mask) || none_visible) return;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < keys; ++j)
        if (!seen(first_query + r, first_key + j)) weights[r * stride + j] = 0;
  }
};

// Whether a key mask allows any of `keys` keys from `first_key`.
bool any_visible(const uint8_t* mask, int64_t first_key, int64_t keys) {
  return std::any_of(mask + first_key, mask + first_key + keys, [](uint8_t v) { return v != 0; });
}

// Per image, whether its key mask allows no key at all (none where there is no mask).
std::vector<char> no_visible_key(const uint8_t* mask, int64_t b, int64_t m) {
  std::vector<char> none(b, 0);
  if (mask)
    for (int64_t image = 0; image < b; ++image)
      none[image] = !any_visible(mask + image * m, 0, m);
  return none;
}

// The bf16 path on AMX tiles (attention_amx.cc): each (image, head)'s keys and values packed once; then per task, an
// (image, head, block of kAttentionRows queries), 16 queries at a time against chunks of amx_chunk(m) keys, the
// softmax online (softmax_rows; a last, shorter chunk row by row, its rows shorter than the logits' stride).
ffi::Error amx_attention(const uint16_t* qp, const uint16_t* kp, const uint16_t* vp, void* op, bool bf16_out,
                         int64_t b, int64_t n, int64_t h, int64_t d, int64_t m, float scale, bool causal,
                         const uint8_t* key_mask, const std::vector<char>& broken) {
  const std::vector<char> none_visible = no_visible_key(key_mask, b, m);
  const int64_t width = amx_width(d), chunk = amx_chunk(m), chunks = amx_chunks(m);
  const int64_t packed_size = amx_packed_size(m, d), hd = h * d;
  auto* packed = static_cast<uint16_t*>(keys_buffer.at_least(packed_size * 2 * b * h));
#pragma omp parallel for
  for (int64_t pair = 0; pair < b * h; ++pair) {
    const int64_t at = (pair / h) * m * hd + (pair % h) * d;
    amx_pack(kp + at, vp + at, hd, m, d, packed + pair * packed_size);
  }
  const int64_t blocks = (n + kAttentionRows - 1) / kAttentionRows;
#pragma omp parallel for schedule(dynamic)
  for (int64_t task = 0; task < b * h * blocks; ++task) {
    const int64_t block = task % blocks, head = (task / blocks) % h, image = task / (blocks * h);
    const int64_t row0 = block * kAttentionRows, rows = std::min(kAttentionRows, n - row0);
    const int64_t q_at = (image * n + row0) * hd + head * d;
    if (broken[image]) {
      fill_nan(op, bf16_out, q_at, rows, hd, d);
      continue;
    }
    FlushDenormals flushed;
    auto* queries = static_cast<uint16_t*>(queries_buffer.at_least(16 * width * 2));
    auto* logits = static_cast<float*>(logits_buffer.at_least(16 * chunk * 4));
    auto* weights = static_cast<uint16_t*>(weights_buffer.at_least(16 * chunk * 2));
    auto* result = static_cast<float*>(out_buffer.at_least(16 * width * 4));
    auto* total = static_cast<float*>(total_buffer.at_least(16 * width * 4));
    const uint16_t* keys_values = packed + (image * h + head) * packed_size;
    float tops[16], sums[16], rescale[16];
    for (int64_t g = 0; g < rows; g += 16) {
      const int64_t count = std::min<int64_t>(16, rows - g);
      std::memset(queries, 0, 16 * width * 2);
      std::memset(weights, 0, 16 * chunk * 2);  // rows past `count`, and keys past m in the last chunk, stay 0
      for (int64_t r = 0; r < count; ++r) std::memcpy(queries + r * width, qp + q_at + (g + r) * hd, d * 2);
      std::fill(tops, tops + 16, -std::numeric_limits<float>::infinity());
      std::fill(sums, sums + 16, 0.f);
      const int64_t first = row0 + g;  // the group's first query
      const Unseen unseen{causal, key_mask ? key_mask + image * m : nullptr, none_visible[image] != 0};
      bool started = false;  // whether a chunk has written `total`
      for (int64_t c = 0; c < chunks; ++c) {
        if (causal && c * chunk > first + count - 1) break;  // keys none of the group's queries sees
        const int64_t keys = std::min(chunk, m - c * chunk);
        if (unseen.mask && !unseen.none_visible && !any_visible(unseen.mask, c * chunk, keys))
          continue;  // a chunk of masked keys only: nothing to add, and no maximum of -inf to rescale from
        amx_logits(queries, d, keys_values, m, c, logits);
        unseen.hide(logits, count, chunk, keys, first, c * chunk);
        if (keys == chunk) {
          softmax_rows(logits, weights, tops, sums, rescale, count, keys, scale);
        } else {  // rows of `keys` logits `chunk` apart, the weights past them left 0
          for (int64_t r = 0; r < count; ++r)
            softmax_rows(logits + r * chunk, weights + r * chunk, tops + r, sums + r, rescale + r, 1, keys, scale);
          for (int64_t r = 0; r < count; ++r) std::memset(weights + r * chunk + keys, 0, (chunk - keys) * 2);
        }
        unseen.zero(weights, count, chunk, keys, first, c * chunk);
        amx_weighted_sum(weights, d, keys_values, m, c, started ? result : total);
        if (std::exchange(started, true))  // the earlier chunks' sum, its maximum having grown, plus this chunk's
          for (int64_t r = 0; r < count; ++r)
            for (int64_t i = 0; i < d; ++i)
              total[r * width + i] = total[r * width + i] * rescale[r] + result[r * width + i];
      }
      for (int64_t r = 0; r < count; ++r) {
        const float inverse = 1.f / sums[r];
        const int64_t at = q_at + (g + r) * hd;
        for (int64_t i = 0; i < d; ++i) {
          const float value = total[r * width + i] * inverse;
          if (bf16_out) static_cast<uint16_t*>(op)[at + i] = to_bf16(value);
          else static_cast<float*>(op)[at + i] = value;
        }
      }
    }
  }
  return ffi::Error::Success();
}

ffi::Error AttentionImpl(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::RemainingArgs rest,
                         ffi::Result<ffi::AnyBuffer> out, float scale, bool causal) {
  const auto given = q.element_type();
  if ((given != ffi::DataType::BF16 && given != ffi::DataType::F32) || k.element_type() != given ||
      v.element_type() != given ||
      (out->element_type() != ffi::DataType::BF16 && out->element_type() != ffi::DataType::F32))
    return ffi::Error::InvalidArgument("onednn_attention takes q, k and v all bf16 or all f32 and gives bf16 or f32");
  auto qd = q.dimensions(), kd = k.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || qd[0] != kd[0] || qd[2] != kd[2] || qd[3] != kd[3])
    return ffi::Error::InvalidArgument("onednn_attention takes q [B, N, H, D] and k, v [B, M, H, D]");
  const int64_t b = qd[0], n = qd[1], h = qd[2], d = qd[3], m = kd[1];
  if (causal && n != m) return ffi::Error::InvalidArgument("causal onednn_attention takes as many keys as queries");
  // The optional key mask, its one remaining operand: [B, M] bools.
  const uint8_t* key_mask = nullptr;
  if (rest.size() > 0) {
    auto mask = rest.get<ffi::AnyBuffer>(0);
    if (rest.size() != 1 || !mask.has_value() || mask->element_type() != ffi::DataType::PRED ||
        mask->dimensions().size() != 2 || mask->dimensions()[0] != b || mask->dimensions()[1] != m || causal)
      return ffi::Error::InvalidArgument("onednn_attention's key mask is [B, M] bools, and not with causal");
    key_mask = static_cast<const uint8_t*>(mask->untyped_data());
  }
  const int64_t blocks = (n + kAttentionRows - 1) / kAttentionRows, tasks = b * h * blocks;
  const bool bf16_out = out->element_type() == ffi::DataType::BF16, f32 = given == ffi::DataType::F32;
  const int64_t size = f32 ? 4 : 2;  // bytes of an element of q, k, v and the weights
  const memory::data_type dt = f32 ? memory::data_type::f32 : memory::data_type::bf16;
  auto* qp = static_cast<const char*>(q.untyped_data());
  auto* kp = static_cast<const char*>(k.untyped_data());
  auto* vp = static_cast<const char*>(v.untyped_data());
  void* op = out->untyped_data();
  if (!f32 && d <= kAmxMaxWidth && amx_tiles())
    return amx_attention(reinterpret_cast<const uint16_t*>(qp), reinterpret_cast<const uint16_t*>(kp),
                         reinterpret_cast<const uint16_t*>(vp), op, bf16_out, b, n, h, d, m, scale, causal, key_mask,
                         broken_images(qp, kp, vp, b, n, m, h * d, f32));
  std::string error;
  // The products' shapes: blocks of up to kAttentionRows queries, `prims[last block]` (the last may be shorter),
  // both reading k and v in the layouts oneDNN picks for a full block.
  const int64_t block_rows = std::min(n, kAttentionRows);
  AttentionPrims* prims[2];
  try {
    prims[0] = attention_for(block_rows, m, d, dt, nullptr, nullptr);
    const memory::desc k_layout = prims[0]->logits_pd.weights_desc(), v_layout = prims[0]->out_pd.weights_desc();
    prims[1] = n % kAttentionRows ? attention_for(n % kAttentionRows, m, d, dt, &k_layout, &v_layout) : prims[0];
  } catch (const dnnl::error& e) {
    return failed(e.what());
  }
  // Each (image, head)'s k^T and v reordered from their strided place in k and v; in f32 with AVX2, k in our own
  // panels for logits_f32 instead of oneDNN's layout.
  const bool own_logits = f32 && f32_loops_avx2();
  const size_t k_size = own_logits ? key_panels_size(m, d) * 4 : prims[0]->logits_pd.weights_desc().get_size();
  const size_t pair_size = k_size + prims[0]->out_pd.weights_desc().get_size();
  char* packed_kv = static_cast<char*>(keys_buffer.at_least(pair_size * b * h));
  const std::vector<char> broken = broken_images(qp, kp, vp, b, n, m, h * d, f32);
  const std::vector<char> none_visible = no_visible_key(key_mask, b, m);
#pragma omp parallel for
  for (int64_t pair = 0; pair < b * h; ++pair) {
    try {
      dnnl::stream stream(cpu());
      const int64_t kv_at = ((pair / h) * m * h + pair % h) * d * size;  // bytes
      const AttentionPrims* p = prims[0];
      char* packed = packed_kv + pair * pair_size;
      memory v_given(memory::desc({m, d}, dt, memory::dims{h * d, 1}), cpu(), const_cast<char*>(vp + kv_at)),
          v_packed(p->out_pd.weights_desc(), cpu(), packed + k_size);
      if (own_logits) {
        pack_key_panels(reinterpret_cast<const float*>(kp + kv_at), h * d, m, d, reinterpret_cast<float*>(packed));
      } else {
        memory k_given(memory::desc({d, m}, dt, memory::dims{1, h * d}), cpu(), const_cast<char*>(kp + kv_at)),
            k_packed(p->logits_pd.weights_desc(), cpu(), packed);
        dnnl::reorder(k_given, k_packed).execute(stream, k_given, k_packed);
      }
      dnnl::reorder(v_given, v_packed).execute(stream, v_given, v_packed);
      stream.wait();
    } catch (const dnnl::error& e) {
#pragma omp critical
      error = e.what();
    }
  }
  if (!error.empty()) return failed(error.c_str());
#pragma omp parallel for schedule(dynamic)
  for (int64_t task = 0; task < tasks; ++task) {
    const int64_t block = task % blocks, head = (task / blocks) % h, image = task / (blocks * h);
    const int64_t row0 = block * kAttentionRows, rows = std::min(kAttentionRows, n - row0);
    if (broken[image]) {
      fill_nan(op, bf16_out, ((image * n + row0) * h + head) * d, rows, h * d, d);
      continue;
    }
    FlushDenormals flushed;
    try {
      dnnl::stream stream(cpu());
      char* queries = static_cast<char*>(queries_buffer.at_least(rows * d * size));
      float* logits = static_cast<float*>(logits_buffer.at_least(rows * m * 4));
      void* weights = f32 ? static_cast<void*>(logits) : weights_buffer.at_least(rows * m * 2);
      float* result = static_cast<float*>(out_buffer.at_least(rows * d * 4));
      const int64_t q_at = ((image * n + row0) * h + head) * d;
      for (int64_t r = 0; r < rows; ++r) std::memcpy(queries + r * d * size, qp + (q_at + r * h * d) * size, d * size);
      std::vector<float> tops(rows, -std::numeric_limits<float>::infinity()), sums(rows, 0.f), rescale(rows);
      const AttentionPrims* p = prims[rows != block_rows];
      char* kv = packed_kv + (image * h + head) * pair_size;
      if (own_logits) {
        logits_f32(reinterpret_cast<const float*>(queries), rows, d, reinterpret_cast<const float*>(kv), m, logits);
      } else {
        memory qm(p->logits_pd.src_desc(), cpu(), queries), km(p->logits_pd.weights_desc(), cpu(), kv),
            lm(p->logits_pd.dst_desc(), cpu(), logits), s1 = scratchpad(p->logits_pd.scratchpad_desc());
        p->logits.execute(stream, {{DNNL_ARG_SRC, qm}, {DNNL_ARG_WEIGHTS, km}, {DNNL_ARG_DST, lm},
                                   {DNNL_ARG_SCRATCHPAD, s1}});
      }
      const Unseen unseen{causal, key_mask ? key_mask + image * m : nullptr, none_visible[image] != 0};
      unseen.hide(logits, rows, m, m, row0, 0);
      if (f32) softmax_rows_f32(logits, sums.data(), rows, m, scale);
      else
        softmax_rows(logits, static_cast<uint16_t*>(weights), tops.data(), sums.data(), rescale.data(), rows, m,
                     scale);
      if (f32) unseen.zero(logits, rows, m, m, row0, 0);  // the weights are the logits, in place
      else unseen.zero(static_cast<uint16_t*>(weights), rows, m, m, row0, 0);
      memory wm(p->out_pd.src_desc(), cpu(), weights), vm(p->out_pd.weights_desc(), cpu(), kv + k_size),
          om(p->out_pd.dst_desc(), cpu(), result), s2 = scratchpad(p->out_pd.scratchpad_desc());
      p->out.execute(stream, {{DNNL_ARG_SRC, wm}, {DNNL_ARG_WEIGHTS, vm}, {DNNL_ARG_DST, om},
                              {DNNL_ARG_SCRATCHPAD, s2}});
      for (int64_t r = 0; r < rows; ++r) {
        const float inverse = 1.f / sums[r];
        const int64_t at = q_at + r * h * d;
        for (int64_t c = 0; c < d; ++c) {
          const float value = result[r * d + c] * inverse;
          if (bf16_out) static_cast<uint16_t*>(op)[at + c] = to_bf16(value);
          else static_cast<float*>(op)[at + c] = value;
        }
      }
    } catch (const dnnl::error& e) {
#pragma omp critical
      error = e.what();
    }
  }
  if (!error.empty()) return failed(error.c_str());
  return ffi::Error::Success();
}

}  // namespace

// Whether bf16 attention runs its products on AMX tiles in this process (attention_amx.cc), for onednn.py.
extern "C" int64_t OnednnAttentionOnAmx() { return jax_sd::amx_tiles() ? 1 : 0; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(OnednnAttention, AttentionImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("scale")
                                  .Attr<bool>("causal"));
