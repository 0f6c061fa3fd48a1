// oneDNN's matrix product and convolutions as XLA FFI handlers for the CPU's native bf16 (engine/nn/onednn.py); built
// into one library with kept.cc (pinned kernels, reordered once), attention.cc and cpu_loops.cc (our own vector
// loops: attention's softmax, GroupNorm + SiLU, GEGLU); onednn.h holds what the handlers share.
//
// Inputs are dense row-major: a matmul's x [M, K], kernel [K, N], bias [N] (f32); a convolution's x NHWC, kernel
// HWIO (flax's layout), bias [O] (f32), out NHWC. x and the kernel share a dtype (bf16 or f32); the output's dtype is
// the call's own (bf16 src with f32 dst is what keeps a network's activations in f32).
// Each shape's primitive is built once and kept; a convolution's kernel is reordered into the layout
// oneDNN picks on every call (as PyTorch's eager bf16 convolution does) unless its buffer is pinned (`OnednnPin`),
// when the reordered kernel is kept; the activations are used in place.
#include <oneapi/dnnl/dnnl.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "cpu_loops.h"
#include "onednn.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using dnnl::memory;
using tag = dnnl::memory::format_tag;

namespace jax_sd {

dnnl::engine& cpu() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

dnnl::primitive_attr own_scratchpad() {
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  return attr;
}

thread_local Buffer scratch_buffer;

memory scratchpad(const memory::desc& desc) {
  return memory(desc, cpu(), scratch_buffer.at_least(std::max<size_t>(desc.get_size(), 64)));
}

std::string key_of(std::initializer_list<int64_t> values) {
  std::string key;
  for (int64_t v : values) key += std::to_string(v) + ",";
  return key;
}

std::mutex cache_lock;

dnnl::matmul::primitive_desc matmul_pd(const memory::desc& x, const memory::desc& w, const memory::desc* bias,
                                       const memory::desc& y, const dnnl::primitive_attr& attr) {
#if DNNL_VERSION_MAJOR >= 3
  return bias ? dnnl::matmul::primitive_desc(cpu(), x, w, *bias, y, attr)
              : dnnl::matmul::primitive_desc(cpu(), x, w, y, attr);
#else
  return dnnl::matmul::primitive_desc(bias ? dnnl::matmul::desc(x, w, *bias, y) : dnnl::matmul::desc(x, w, y), attr,
                                      cpu());
#endif
}

ffi::Error failed(const char* what) { return ffi::Error(ffi::ErrorCode::kInternal, what); }

}  // namespace jax_sd

namespace {

using namespace jax_sd;

bool dtype_of(ffi::DataType type, memory::data_type* out) {
  if (type == ffi::DataType::BF16) *out = memory::data_type::bf16;
  else if (type == ffi::DataType::F32) *out = memory::data_type::f32;
  else return false;
  return true;
}

// What a convolution does after its product, inside oneDNN's kernel (post-ops), so that the output is written once:
// add an operand of the output's shape (a residual connection), then ReLU. `code` tells primitives apart in the
// cache. (For the UNet's residual adds a post-op measured slower than XLA's own fusion: used by TAESD's blocks.)
struct After {
  bool add = false;
  memory::data_type add_type = memory::data_type::f32;
  bool relu = false;
  int64_t code() const { return (add ? 1 + 4 * int64_t(add_type) : 0) + (relu ? 2 : 0); }
};

// The attributes of a primitive whose output is laid out as `added` describes (with the residual's dtype).
dnnl::primitive_attr attr_for(const After& after, const memory::desc& added) {
  dnnl::primitive_attr attr = own_scratchpad();
  dnnl::post_ops ops;
  if (after.add) ops.append_binary(dnnl::algorithm::binary_add, added);
#if DNNL_VERSION_MAJOR >= 3
  if (after.relu) ops.append_eltwise(dnnl::algorithm::eltwise_relu, 0.f, 0.f);
#else
  if (after.relu) ops.append_eltwise(1.f, dnnl::algorithm::eltwise_relu, 0.f, 0.f);
#endif
  attr.set_post_ops(ops);
  return attr;
}

// The activation a matmul applies to its f32 sums (bias added) before rounding them to its output dtype, as a post-op:
// the transformer MLPs' first layer, whose output is then written once and rounded once (the SD-Turbo text encoder's
// 23 GELUs no longer a pass of XLA's over [77, 4096] each: 104-107 -> 97-101 ms on 2 Xeon cores with AMX). The
// numbers are onednn.py's ACTIVATION_CODES. Then, where the call has a multiplier (an operand of the output's shape,
// bf16 or f32), the product by it, a post-op too: SwiGLU's silu(gate x) * up x in one write (Z-Image's and Qwen3's
// MLPs).
enum class Activation : int64_t { kNone = 0, kGeluErf = 1, kGeluTanh = 2, kQuickGelu = 3, kSilu = 4 };

bool activation_of(int64_t code, Activation* out) {
  if (code < 0 || code > int64_t(Activation::kSilu)) return false;
  *out = Activation(code);
  return true;
}

dnnl::primitive_attr matmul_attr(Activation activation, const memory::desc* multiplier) {
  dnnl::primitive_attr attr = own_scratchpad();
  dnnl::post_ops ops;
  if (activation != Activation::kNone) {
    // quick_gelu, x * sigmoid(1.702 x), is oneDNN's swish with alpha 1.702; silu is swish with alpha 1.
    const dnnl::algorithm algorithm = activation == Activation::kGeluErf    ? dnnl::algorithm::eltwise_gelu_erf
                                      : activation == Activation::kGeluTanh ? dnnl::algorithm::eltwise_gelu_tanh
                                                                            : dnnl::algorithm::eltwise_swish;
    const float alpha = activation == Activation::kQuickGelu ? 1.702f : 1.f;
#if DNNL_VERSION_MAJOR >= 3
    ops.append_eltwise(algorithm, alpha, 0.f);
#else
    ops.append_eltwise(1.f, algorithm, alpha, 0.f);
#endif
  }
  if (multiplier) ops.append_binary(dnnl::algorithm::binary_mul, *multiplier);
  attr.set_post_ops(ops);
  return attr;
}

thread_local Buffer kernel_buffer;

struct Matmul {
  dnnl::matmul::primitive_desc pd;  // the kernel as it arrives, [K, N] row-major
  dnnl::matmul primitive;
  dnnl::matmul::primitive_desc kept_pd;  // the kernel in the layout oneDNN picks: for a pinned kernel (`kept`)
  dnnl::matmul kept_primitive;
};

struct Conv {
  dnnl::convolution_forward::primitive_desc pd;
  dnnl::convolution_forward primitive;
  memory::desc given_kernel;  // HWIO as it arrives
};

std::unordered_map<std::string, std::unique_ptr<Matmul>> matmuls;
std::unordered_map<std::string, std::unique_ptr<Conv>> convs;

// `times`: the multiplier's dtype, where the call has one.
Matmul* matmul_for(int64_t m, int64_t k, int64_t n, memory::data_type src, memory::data_type dst,
                   Activation activation, const memory::data_type* times) {
  const int64_t times_code = times ? 1 + int64_t(*times) : 0;
  return cached(matmuls, key_of({m, k, n, int64_t(src), int64_t(dst), int64_t(activation), times_code}), [&] {
    memory::desc x({m, k}, src, tag::ab), w({k, n}, src, tag::ab), b({1, n}, memory::data_type::f32, tag::ab),
        y({m, n}, dst, tag::ab);
    memory::desc w_any({k, n}, src, tag::any);
    const memory::desc multiplier = times ? memory::desc({m, n}, *times, tag::ab) : memory::desc();
    const dnnl::primitive_attr attr = matmul_attr(activation, times ? &multiplier : nullptr);
    auto pd = matmul_pd(x, w, &b, y, attr), kept_pd = matmul_pd(x, w_any, &b, y, attr);
    return new Matmul{pd, dnnl::matmul(pd), kept_pd, dnnl::matmul(kept_pd)};
  });
}

Conv* conv_for(const int64_t* d, memory::data_type src, memory::data_type dst, const After& after) {
  // d: batch, h, w, in, kh, kw, out, out_h, out_w, stride_h, stride_w, pad_top, pad_left, pad_bottom, pad_right
  std::string key = key_of({d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7], d[8], d[9], d[10], d[11], d[12], d[13],
                            d[14], int64_t(src), int64_t(dst), after.code()});
  return cached(convs, key, [&] {
    memory::desc x({d[0], d[3], d[1], d[2]}, src, tag::nhwc), y({d[0], d[6], d[7], d[8]}, dst, tag::nhwc),
        w_any({d[6], d[3], d[4], d[5]}, src, tag::any), w_given({d[6], d[3], d[4], d[5]}, src, tag::hwio),
        b({d[6]}, memory::data_type::f32, tag::a);
    memory::dims strides{d[9], d[10]}, pad_l{d[11], d[12]}, pad_r{d[13], d[14]};
    auto attr = attr_for(after, memory::desc({d[0], d[6], d[7], d[8]}, after.add_type, tag::nhwc));
#if DNNL_VERSION_MAJOR >= 3
    dnnl::convolution_forward::primitive_desc pd(cpu(), dnnl::prop_kind::forward_inference,
                                                 dnnl::algorithm::convolution_direct, x, w_any, b, y, strides, pad_l,
                                                 pad_r, attr);
#else
    dnnl::convolution_forward::primitive_desc pd(
        dnnl::convolution_forward::desc(dnnl::prop_kind::forward_inference, dnnl::algorithm::convolution_direct, x,
                                        w_any, b, y, strides, pad_l, pad_r),
        attr, cpu());
#endif
    return new Conv{pd, dnnl::convolution_forward(pd), w_given};
  });
}

// A call's optional operand of the output's size (its one remaining operand: a convolution's residual, a matmul's
// multiplier), bf16 or f32: true where there is none (`*data` null) or one such, false otherwise.
bool extra_operand(const ffi::RemainingArgs& rest, int64_t count, void** data, memory::data_type* type) {
  *data = nullptr;
  if (rest.size() == 0) return true;
  auto given = rest.get<ffi::AnyBuffer>(0);
  if (rest.size() != 1 || !given.has_value() || int64_t(given->element_count()) != count ||
      !dtype_of(given->element_type(), type))
    return false;
  *data = given->untyped_data();
  return true;
}

// The call's optional residual (its one remaining operand) and what to do after the product; false where the residual
// is not of the output's size or dtype.
bool after_of(const ffi::RemainingArgs& rest, const ffi::AnyBuffer& out, bool relu, After* after,
              void** residual) {
  after->relu = relu;
  if (!extra_operand(rest, int64_t(out.element_count()), residual, &after->add_type)) return false;
  after->add = *residual != nullptr;
  return true;
}

ffi::Error MatmulImpl(ffi::AnyBuffer x, ffi::AnyBuffer kernel, ffi::AnyBuffer bias, ffi::RemainingArgs rest,
                      ffi::Result<ffi::AnyBuffer> out, int64_t activation_code) {
  memory::data_type src, dst;
  if (!dtype_of(x.element_type(), &src) || !dtype_of(out->element_type(), &dst) ||
      kernel.element_type() != x.element_type() || bias.element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("onednn_matmul takes bf16 or f32 x and kernel alike, an f32 bias");
  auto dims = kernel.dimensions();
  if (dims.size() != 2) return ffi::Error::InvalidArgument("onednn_matmul's kernel is [K, N]");
  int64_t k = dims[0], n = dims[1], m = x.element_count() / k;
  if (k == 0 || int64_t(x.element_count()) != m * k || int64_t(out->element_count()) != m * n ||
      int64_t(bias.element_count()) != n)
    return ffi::Error::InvalidArgument("onednn_matmul takes x [M, K], kernel [K, N], bias [N] and gives [M, N]");
  Activation activation;
  if (!activation_of(activation_code, &activation))
    return ffi::Error::InvalidArgument(
        "onednn_matmul's activation is 0 (none), 1 (GELU), 2 (tanh GELU), 3 (quick GELU) or 4 (SiLU)");
  void* times;  // the optional multiplier: [M, N], bf16 or f32
  memory::data_type times_type = memory::data_type::f32;
  if (!extra_operand(rest, m * n, &times, &times_type))
    return ffi::Error::InvalidArgument("onednn_matmul's multiplier has the output's shape, in bf16 or f32");
  try {
    Matmul* mm = matmul_for(m, k, n, src, dst, activation, times ? &times_type : nullptr);
    dnnl::stream stream(cpu());
    // A pinned kernel runs in oneDNN's own layout, reordered once; any other as it is (oneDNN then copies it into
    // blocks on every call).
    std::shared_ptr<void> weights;
    if (mm->kept_pd.weights_desc() != mm->pd.weights_desc())
      weights = kept(kernel.untyped_data(), kernel.size_bytes(), mm->pd.weights_desc(), mm->kept_pd.weights_desc(),
                     stream);
    const auto& pd = weights ? mm->kept_pd : mm->pd;
    memory xm(pd.src_desc(), cpu(), x.untyped_data()),
        wm(pd.weights_desc(), cpu(), weights ? weights.get() : kernel.untyped_data()),
        bm(pd.bias_desc(), cpu(), bias.untyped_data()), ym(pd.dst_desc(), cpu(), out->untyped_data());
    memory scratch = scratchpad(pd.scratchpad_desc());
    std::unordered_map<int, memory> args{{DNNL_ARG_SRC, xm}, {DNNL_ARG_WEIGHTS, wm}, {DNNL_ARG_BIAS, bm},
                                         {DNNL_ARG_DST, ym}, {DNNL_ARG_SCRATCHPAD, scratch}};
    if (times)  // the last post-op: after the activation where there is one
      args[DNNL_ARG_ATTR_MULTIPLE_POST_OP(activation == Activation::kNone ? 0 : 1) | DNNL_ARG_SRC_1] =
          memory(memory::desc({m, n}, times_type, tag::ab), cpu(), times);
    (weights ? mm->kept_primitive : mm->primitive).execute(stream, args);
    stream.wait();
  } catch (const dnnl::error& e) {
    return failed(e.what());
  }
  return ffi::Error::Success();
}

ffi::Error ConvImpl(ffi::AnyBuffer x, ffi::AnyBuffer kernel, ffi::AnyBuffer bias, ffi::RemainingArgs rest,
                    ffi::Result<ffi::AnyBuffer> out, ffi::Span<const int64_t> strides, ffi::Span<const int64_t> padding,
                    bool relu) {
  After after;
  void* residual;
  if (!after_of(rest, *out, relu, &after, &residual))
    return ffi::Error::InvalidArgument("onednn_conv's residual has the output's shape, in bf16 or f32");
  memory::data_type src, dst;
  if (!dtype_of(x.element_type(), &src) || !dtype_of(out->element_type(), &dst) ||
      kernel.element_type() != x.element_type() || bias.element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("onednn_conv takes bf16 or f32 x and kernel alike, an f32 bias");
  auto xd = x.dimensions(), kd = kernel.dimensions(), yd = out->dimensions();
  if (xd.size() != 4 || kd.size() != 4 || yd.size() != 4 || strides.size() != 2 || padding.size() != 4)
    return ffi::Error::InvalidArgument("onednn_conv takes NHWC x, an HWIO kernel, 2 strides and 4 paddings");
  int64_t d[15] = {xd[0], xd[1], xd[2], xd[3], kd[0], kd[1], kd[3], yd[1], yd[2],
                   strides[0], strides[1], padding[0], padding[1], padding[2], padding[3]};
  try {
    Conv* c = conv_for(d, src, dst, after);
    dnnl::stream stream(cpu());
    memory given(c->given_kernel, cpu(), kernel.untyped_data());
    memory wm = given;
    std::shared_ptr<void> weights;  // a pinned kernel's, reordered once and held while this call reads it
    if (c->pd.weights_desc() != c->given_kernel) {
      weights = kept(kernel.untyped_data(), kernel.size_bytes(), c->given_kernel, c->pd.weights_desc(), stream);
      wm = memory(c->pd.weights_desc(), cpu(),
                  weights ? weights.get() : kernel_buffer.at_least(c->pd.weights_desc().get_size()));
      if (!weights) dnnl::reorder(given, wm).execute(stream, given, wm);
    }
    memory xm(c->pd.src_desc(), cpu(), x.untyped_data()), bm(c->pd.bias_desc(), cpu(), bias.untyped_data()),
        ym(c->pd.dst_desc(), cpu(), out->untyped_data());
    memory scratch = scratchpad(c->pd.scratchpad_desc());
    std::unordered_map<int, memory> args{{DNNL_ARG_SRC, xm}, {DNNL_ARG_WEIGHTS, wm}, {DNNL_ARG_BIAS, bm},
                                         {DNNL_ARG_DST, ym}, {DNNL_ARG_SCRATCHPAD, scratch}};
    if (residual)
      args[DNNL_ARG_ATTR_MULTIPLE_POST_OP(0) | DNNL_ARG_SRC_1] =
          memory(memory::desc({d[0], d[6], d[7], d[8]}, after.add_type, tag::nhwc), cpu(), residual);
    c->primitive.execute(stream, args);
    stream.wait();
  } catch (const dnnl::error& e) {
    return failed(e.what());
  }
  return ffi::Error::Success();
}

// Nearest 2x upsampling, then a 3x3 convolution with padding 1 (the UNet's, the VAEs' and TAESD's upsamplers), as
// four 2x2 convolutions over x itself, one per output phase (a, b) = (row, column) % 2: out[2i + a][2j + b] reads
// x's rows i - 1 + a .. i + a and columns j - 1 + b .. j + b, each tap the sum of the 3x3 taps that land on the same
// pixel of x. 16 of every 36 products, and no upsampled x written; the phases' outputs are then interleaved.
// A phase kernel sums two or four bf16 taps in f32 and rounds once: within bf16's resolution of the plain order.
void phase_kernel(const uint16_t* kernel, int64_t c, int64_t o, int a, int b, uint16_t* phase) {
  // which 3x3 taps fall on the 2x2 kernel's first and second row (column) in phase a (b)
  static const int first[2][2] = {{0, 1}, {0, 2}}, last[2][2] = {{0, 2}, {1, 2}};  // [phase][tap]: a range of taps
  const int64_t taps = c * o;
  for (int ty = 0; ty < 2; ++ty)
    for (int tx = 0; tx < 2; ++tx)
      for (int64_t i = 0; i < taps; ++i) {
        float sum = 0.f;
        for (int dy = first[a][ty]; dy <= last[a][ty]; ++dy)
          for (int dx = first[b][tx]; dx <= last[b][tx]; ++dx) {
            uint32_t bits = uint32_t(kernel[(dy * 3 + dx) * taps + i]) << 16;
            float value;
            std::memcpy(&value, &bits, 4);
            sum += value;
          }
        phase[(ty * 2 + tx) * taps + i] = to_bf16(sum);
      }
}

thread_local Buffer phase_buffer;

ffi::Error UpsampleConvImpl(ffi::AnyBuffer x, ffi::AnyBuffer kernel, ffi::AnyBuffer bias,
                            ffi::Result<ffi::AnyBuffer> out) {
  memory::data_type dst;
  if (x.element_type() != ffi::DataType::BF16 || kernel.element_type() != ffi::DataType::BF16 ||
      bias.element_type() != ffi::DataType::F32 || !dtype_of(out->element_type(), &dst))
    return ffi::Error::InvalidArgument("onednn_upsample_conv takes bf16 x and kernel, an f32 bias");
  auto xd = x.dimensions(), kd = kernel.dimensions(), yd = out->dimensions();
  if (xd.size() != 4 || kd.size() != 4 || yd.size() != 4 || kd[0] != 3 || kd[1] != 3 || kd[2] != xd[3] ||
      yd[0] != xd[0] || yd[1] != 2 * xd[1] || yd[2] != 2 * xd[2] || yd[3] != kd[3])
    return ffi::Error::InvalidArgument("onednn_upsample_conv takes NHWC x, a 3x3 HWIO kernel, out [N, 2H, 2W, O]");
  const int64_t n = xd[0], h = xd[1], w = xd[2], c = xd[3], o = kd[3];
  const size_t item = dst == memory::data_type::bf16 ? 2 : 4, phase_bytes = size_t(n * h * w * o) * item;
  std::shared_ptr<void> held = aligned_block(4 * phase_bytes);  // the phases' outputs: freed after the call
  char* phases = static_cast<char*>(held.get());
  try {
    dnnl::stream stream(cpu());
    for (int a = 0; a < 2; ++a)
      for (int b = 0; b < 2; ++b) {
        int64_t d[15] = {n, h, w, c, 2, 2, o, h, w, 1, 1, 1 - a, 1 - b, a, b};
        Conv* conv = conv_for(d, memory::data_type::bf16, dst, After());
        const memory::desc& want = conv->pd.weights_desc();
        auto derive = [&](memory& to) {  // this phase's 2x2 HWIO kernel, in the layout the convolution reads
          auto* given = static_cast<uint16_t*>(phase_buffer.at_least(4 * c * o * 2));
          phase_kernel(static_cast<const uint16_t*>(kernel.untyped_data()), c, o, a, b, given);
          memory from(conv->given_kernel, cpu(), given);
          dnnl::reorder(from, to).execute(stream, from, to);
          stream.wait();
        };
        std::shared_ptr<void> weights = kept(kernel.untyped_data(), kernel.size_bytes(), want, 1 + 2 * a + b, derive);
        memory wm(want, cpu(), weights ? weights.get() : kernel_buffer.at_least(want.get_size()));
        if (!weights) derive(wm);
        memory xm(conv->pd.src_desc(), cpu(), x.untyped_data()), bm(conv->pd.bias_desc(), cpu(), bias.untyped_data()),
            ym(conv->pd.dst_desc(), cpu(), phases + (2 * a + b) * phase_bytes);
        memory scratch = scratchpad(conv->pd.scratchpad_desc());
        conv->primitive.execute(stream, {{DNNL_ARG_SRC, xm}, {DNNL_ARG_WEIGHTS, wm}, {DNNL_ARG_BIAS, bm},
                                         {DNNL_ARG_DST, ym}, {DNNL_ARG_SCRATCHPAD, scratch}});
        stream.wait();
      }
  } catch (const dnnl::error& e) {
    return failed(e.what());
  }
  const size_t pixel = size_t(o) * item;
  char* y = static_cast<char*>(out->untyped_data());
#pragma omp parallel for
  for (int64_t row = 0; row < n * h; ++row)  // x's row i of image `row / h` -> out's rows 2i and 2i + 1
    for (int a = 0; a < 2; ++a)
      for (int64_t j = 0; j < w; ++j)
        for (int b = 0; b < 2; ++b)
          std::memcpy(y + (((row / h) * 2 * h + 2 * (row % h) + a) * 2 * w + 2 * j + b) * pixel,
                      phases + (2 * a + b) * phase_bytes + (row * w + j) * pixel, pixel);
  return ffi::Error::Success();
}

}  // namespace

// The instruction set oneDNN's kernels dispatch to in this process (dnnl_cpu_isa_t's bits: 0x7 AVX2, 0x27
// AVX-512, ...), after ONEDNN_MAX_CPU_ISA's cap: what the cap's test asks of the library it loaded.
extern "C" int64_t OnednnEffectiveIsa() { return int64_t(dnnl::get_effective_cpu_isa()); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(OnednnMatmul, MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("activation"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(OnednnUpsampleConv, UpsampleConvImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(OnednnConv, ConvImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<ffi::Span<const int64_t>>("strides")
                                  .Attr<ffi::Span<const int64_t>>("padding")
                                  .Attr<bool>("relu"));
