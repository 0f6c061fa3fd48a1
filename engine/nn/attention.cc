// Attention as one XLA FFI handler (engine/nn/onednn.py): two products per block of queries around our own softmax
// (cpu_loops.cc), built into the same library as onednn.cc. The weighted sum is oneDNN's; so are the logits in bf16,
// and in f32 where the CPU has no AVX2, while f32 with AVX2 takes our own logits kernel (cpu_loops.cc logits_f32).
#include <oneapi/dnnl/dnnl.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

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
// queries copied into contiguous rows, the logits [rows, M] (or a chunk of keys at a time, below; single-threaded
// inside the parallel loop), the softmax over them while they are in the cache, the weights as bf16 (or in f32, over
// the logits themselves) into the second product, then each row divided by its sum. Nothing the size of all the logits is ever written. In f32
// (CPUs without native bf16) this replaces XLA's query blocks, which copy k and v into their layout again for every
// block and run the softmax in passes of their own: SD 2.1's 4096-token self-attention on a Zen 3 core pair went
// from XLA's 2.8 s to 1.5 s (cores loaded by other work; nn/attention.py CPU_ONEDNN_F32_KEYS). Our own f32 logits
// took SD 2.1's 4096-token attention (5 heads of 64) from about 220 to 160 ms on a quiet Zen 3 core pair, and
// flushing denormals (FlushDenormals) keeps wide logits from costing 40% more (bench/kernels_f32.py's attention).
constexpr int64_t kAttentionRows = 256;
// On AMX, where oneDNN would run a row's logits on its AVX-512 kernels, the keys are taken kAttentionKeys at a time,
// the softmax online (flash attention's way). oneDNN 3.2 runs the logits of 256 queries against 512 or 4096 keys on
// AMX but against 1024 or 2048 on AVX-512, 2x slower, and for 64 or 128 queries never on AMX, so the chunks are cut
// along the keys. Measured on a 2-core AVX-512 Xeon with AMX: SD 2.1's 1024-token self-attention (10 heads of 64)
// alone 8.6 -> 3.9 ms (best of 20), the 32x32 level's attention inside an SD-Turbo step 66-67 -> 50-51 ms (two
// profiles each). Its 4096-token one, already on AMX, chunked too went 30.3 -> 28.8 ms alone but 205 -> 249 ms
// inside a step, so a row oneDNN runs on AMX whole stays whole. Without AMX (capped to AVX512-BF16 on the same
// Xeon) chunks were 3-7% slower, so there no row is chunked.
constexpr int64_t kAttentionKeys = 512;

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

// Whether a block's logits run on oneDNN's AMX kernels.
bool on_amx(const AttentionPrims* prims) {
  return std::string(prims->logits_pd.impl_info_str()).find("amx") != std::string::npos;
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

ffi::Error AttentionImpl(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::Result<ffi::AnyBuffer> out,
                         float scale) {
  const auto given = q.element_type();
  if ((given != ffi::DataType::BF16 && given != ffi::DataType::F32) || k.element_type() != given ||
      v.element_type() != given ||
      (out->element_type() != ffi::DataType::BF16 && out->element_type() != ffi::DataType::F32))
    return ffi::Error::InvalidArgument("onednn_attention takes q, k and v all bf16 or all f32 and gives bf16 or f32");
  auto qd = q.dimensions(), kd = k.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || qd[0] != kd[0] || qd[2] != kd[2] || qd[3] != kd[3])
    return ffi::Error::InvalidArgument("onednn_attention takes q [B, N, H, D] and k, v [B, M, H, D]");
  const int64_t b = qd[0], n = qd[1], h = qd[2], d = qd[3], m = kd[1];
  const int64_t blocks = (n + kAttentionRows - 1) / kAttentionRows, tasks = b * h * blocks;
  const bool bf16_out = out->element_type() == ffi::DataType::BF16, f32 = given == ffi::DataType::F32;
  const int64_t size = f32 ? 4 : 2;  // bytes of an element of q, k, v and the weights
  const memory::data_type dt = f32 ? memory::data_type::f32 : memory::data_type::bf16;
  auto* qp = static_cast<const char*>(q.untyped_data());
  auto* kp = static_cast<const char*>(k.untyped_data());
  auto* vp = static_cast<const char*>(v.untyped_data());
  void* op = out->untyped_data();
  std::string error;
  // The products' shapes: blocks of up to kAttentionRows queries (the last may be shorter) against chunks of
  // `chunk` keys (the last may be shorter): `prims[last block][last chunk]`, every one reading k and v in the
  // layouts oneDNN picks for a full block of its chunk's length.
  const int64_t block_rows = std::min(n, kAttentionRows);
  int64_t chunk = m, chunks = 1;
  AttentionPrims* prims[2][2];
  try {
    if (amx_allowed() && !f32 && m > kAttentionKeys && !on_amx(attention_for(block_rows, m, d, dt, nullptr, nullptr)))
      chunk = kAttentionKeys;
    chunks = (m + chunk - 1) / chunk;
    for (int last = 0; last < 2; ++last) {
      const int64_t keys = last ? m - (chunks - 1) * chunk : chunk;
      AttentionPrims* full = attention_for(block_rows, keys, d, dt, nullptr, nullptr);
      const memory::desc k_layout = full->logits_pd.weights_desc(), v_layout = full->out_pd.weights_desc();
      prims[0][last] = full;
      prims[1][last] = n % kAttentionRows ? attention_for(n % kAttentionRows, keys, d, dt, &k_layout, &v_layout) : full;
    }
  } catch (const dnnl::error& e) {
    return failed(e.what());
  }
  // Each (image, head)'s k^T and v, chunk by chunk, reordered from their strided place in k and v; in f32 with AVX2,
  // k in our own panels for logits_f32 instead of oneDNN's layout.
  const bool own_logits = f32 && f32_loops_avx2();
  size_t k_size[2], v_size[2];  // bytes of a chunk's packed k and v: [last chunk]
  for (int last = 0; last < 2; ++last) {
    k_size[last] = own_logits ? key_panels_size(m, d) * 4 : prims[0][last]->logits_pd.weights_desc().get_size();
    v_size[last] = prims[0][last]->out_pd.weights_desc().get_size();
  }
  const size_t chunk_size = k_size[0] + v_size[0], pair_size = (chunks - 1) * chunk_size + k_size[1] + v_size[1];
  char* packed_kv = static_cast<char*>(keys_buffer.at_least(pair_size * b * h));
  std::vector<char> broken(b);
#pragma omp parallel for
  for (int64_t image = 0; image < b; ++image)
    broken[image] = non_finite(qp + image * n * h * d * size, n * h * d, f32) ||
                    non_finite(kp + image * m * h * d * size, m * h * d, f32) ||
                    non_finite(vp + image * m * h * d * size, m * h * d, f32);
#pragma omp parallel for
  for (int64_t pair = 0; pair < b * h; ++pair) {
    try {
      dnnl::stream stream(cpu());
      for (int64_t c = 0; c < chunks; ++c) {
        const int last = c == chunks - 1;
        const int64_t keys = last ? m - c * chunk : chunk;
        const int64_t kv_at = (((pair / h) * m + c * chunk) * h + pair % h) * d * size;  // bytes
        const AttentionPrims* p = prims[0][last];
        char* packed = packed_kv + pair * pair_size + c * chunk_size;
        memory v_given(memory::desc({keys, d}, dt, memory::dims{h * d, 1}), cpu(), const_cast<char*>(vp + kv_at)),
            v_packed(p->out_pd.weights_desc(), cpu(), packed + k_size[last]);
        if (own_logits) {
          pack_key_panels(reinterpret_cast<const float*>(kp + kv_at), h * d, m, d, reinterpret_cast<float*>(packed));
        } else {
          memory k_given(memory::desc({d, keys}, dt, memory::dims{1, h * d}), cpu(), const_cast<char*>(kp + kv_at)),
              k_packed(p->logits_pd.weights_desc(), cpu(), packed);
          dnnl::reorder(k_given, k_packed).execute(stream, k_given, k_packed);
        }
        dnnl::reorder(v_given, v_packed).execute(stream, v_given, v_packed);
      }
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
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < d; ++c) {
          const int64_t at = ((image * n + row0 + r) * h + head) * d + c;
          if (bf16_out) static_cast<uint16_t*>(op)[at] = 0x7FC0;
          else static_cast<float*>(op)[at] = std::numeric_limits<float>::quiet_NaN();
        }
      continue;
    }
    FlushDenormals flushed;
    try {
      dnnl::stream stream(cpu());
      char* queries = static_cast<char*>(queries_buffer.at_least(rows * d * size));
      float* logits = static_cast<float*>(logits_buffer.at_least(rows * chunk * 4));
      void* weights = f32 ? static_cast<void*>(logits) : weights_buffer.at_least(rows * chunk * 2);
      float* result = static_cast<float*>(out_buffer.at_least(rows * d * 4));
      float* total = chunks == 1 ? result : static_cast<float*>(total_buffer.at_least(rows * d * 4));
      const int64_t q_at = ((image * n + row0) * h + head) * d;
      for (int64_t r = 0; r < rows; ++r) std::memcpy(queries + r * d * size, qp + (q_at + r * h * d) * size, d * size);
      std::vector<float> tops(rows, -std::numeric_limits<float>::infinity()), sums(rows, 0.f), rescale(rows);
      for (int64_t c = 0; c < chunks; ++c) {
        const int last = c == chunks - 1;
        const int64_t keys = last ? m - c * chunk : chunk;
        const AttentionPrims* p = prims[rows != block_rows][last];
        char* kv = packed_kv + (image * h + head) * pair_size + c * chunk_size;
        if (own_logits) {
          logits_f32(reinterpret_cast<const float*>(queries), rows, d, reinterpret_cast<const float*>(kv), m, logits);
        } else {
          memory qm(p->logits_pd.src_desc(), cpu(), queries), km(p->logits_pd.weights_desc(), cpu(), kv),
              lm(p->logits_pd.dst_desc(), cpu(), logits), s1 = scratchpad(p->logits_pd.scratchpad_desc());
          p->logits.execute(stream, {{DNNL_ARG_SRC, qm}, {DNNL_ARG_WEIGHTS, km}, {DNNL_ARG_DST, lm},
                                     {DNNL_ARG_SCRATCHPAD, s1}});
        }
        if (f32) softmax_rows_f32(logits, sums.data(), rows, m, scale);  // one chunk: all of m
        else
          softmax_rows(logits, static_cast<uint16_t*>(weights), tops.data(), sums.data(), rescale.data(), rows, keys,
                       scale);
        memory wm(p->out_pd.src_desc(), cpu(), weights), vm(p->out_pd.weights_desc(), cpu(), kv + k_size[last]),
            om(p->out_pd.dst_desc(), cpu(), result), s2 = scratchpad(p->out_pd.scratchpad_desc());
        p->out.execute(stream, {{DNNL_ARG_SRC, wm}, {DNNL_ARG_WEIGHTS, vm}, {DNNL_ARG_DST, om},
                                {DNNL_ARG_SCRATCHPAD, s2}});
        if (chunks > 1 && c == 0) std::memcpy(total, result, rows * d * 4);
        else if (chunks > 1)  // the earlier chunks' weighted sum, its maximum having grown, plus this chunk's
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t i = 0; i < d; ++i) total[r * d + i] = total[r * d + i] * rescale[r] + result[r * d + i];
      }
      for (int64_t r = 0; r < rows; ++r) {
        const float inverse = 1.f / sums[r];
        const int64_t at = q_at + r * h * d;
        for (int64_t c = 0; c < d; ++c) {
          float value = total[r * d + c] * inverse;
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(OnednnAttention, AttentionImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("scale"));
