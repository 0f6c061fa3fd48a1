// oneDNN's matrix product and convolution as XLA FFI handlers, for the CPU's native bf16 (engine/nn/onednn.py).
//
// Inputs are dense row-major: a matmul's x [M, K], kernel [K, N], bias [N] (f32); a convolution's x NHWC,
// kernel HWIO (flax's layout), bias [O] (f32), out NHWC. x and the kernel share a dtype (bf16 or f32); the
// output's dtype is the call's own (bf16 src with f32 dst is what keeps a network's activations in f32).
// Each shape's primitive is built once and kept; a convolution's kernel is reordered into the layout
// oneDNN picks on every call (as PyTorch's eager bf16 convolution does), the activations are used in place.
#include <oneapi/dnnl/dnnl.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using dnnl::memory;
using tag = dnnl::memory::format_tag;

namespace {

dnnl::engine& cpu() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

bool dtype_of(ffi::DataType type, memory::data_type* out) {
  if (type == ffi::DataType::BF16) *out = memory::data_type::bf16;
  else if (type == ffi::DataType::F32) *out = memory::data_type::f32;
  else return false;
  return true;
}

// Each call brings its own scratchpad: with the library's shared one, a primitive must not run on two threads at
// once, and XLA runs a program's partitions (the engine's devices) on threads of their own.
dnnl::primitive_attr own_scratchpad() {
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  return attr;
}

// A thread's reusable buffer (scratchpads, reordered kernels): fresh memory on every call costs its page faults.
struct Buffer {
  void* data = nullptr;
  size_t size = 0;
  ~Buffer() { std::free(data); }
  void* at_least(size_t want) {
    if (want > size) {
      std::free(data);
      size = (want + 4095) / 4096 * 4096;
      data = std::aligned_alloc(64, size);
    }
    return data;
  }
};
thread_local Buffer scratch_buffer, kernel_buffer;

memory scratchpad(const memory::desc& desc) {
  return memory(desc, cpu(), scratch_buffer.at_least(std::max<size_t>(desc.get_size(), 64)));
}

std::string key_of(std::initializer_list<int64_t> values) {
  std::string key;
  for (int64_t v : values) key += std::to_string(v) + ",";
  return key;
}

struct Matmul {
  dnnl::matmul::primitive_desc pd;
  dnnl::matmul primitive;
};

struct BatchedMatmul {
  dnnl::matmul::primitive_desc pd;
  dnnl::matmul primitive;
};

struct Conv {
  dnnl::convolution_forward::primitive_desc pd;
  dnnl::convolution_forward primitive;
  memory::desc given_kernel;  // HWIO as it arrives
};

std::mutex cache_lock;
std::unordered_map<std::string, std::unique_ptr<Matmul>> matmuls;
std::unordered_map<std::string, std::unique_ptr<Conv>> convs;
std::unordered_map<std::string, std::unique_ptr<BatchedMatmul>> batched;

BatchedMatmul* batched_for(int64_t b, int64_t m, int64_t k, int64_t n, memory::data_type src, memory::data_type dst) {
  std::lock_guard<std::mutex> guard(cache_lock);
  auto& slot = batched[key_of({b, m, k, n, int64_t(src), int64_t(dst)})];
  if (!slot) {
    memory::desc x({b, m, k}, src, tag::abc), w({b, k, n}, src, tag::abc), y({b, m, n}, dst, tag::abc);
#if DNNL_VERSION_MAJOR >= 3
    dnnl::matmul::primitive_desc pd(cpu(), x, w, y, own_scratchpad());
#else
    dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(x, w, y), own_scratchpad(), cpu());
#endif
    slot.reset(new BatchedMatmul{pd, dnnl::matmul(pd)});
  }
  return slot.get();
}

Matmul* matmul_for(int64_t m, int64_t k, int64_t n, memory::data_type src, memory::data_type dst) {
  std::lock_guard<std::mutex> guard(cache_lock);
  auto& slot = matmuls[key_of({m, k, n, int64_t(src), int64_t(dst)})];
  if (!slot) {
    memory::desc x({m, k}, src, tag::ab), w({k, n}, src, tag::ab), b({1, n}, memory::data_type::f32, tag::ab),
        y({m, n}, dst, tag::ab);
#if DNNL_VERSION_MAJOR >= 3
    dnnl::matmul::primitive_desc pd(cpu(), x, w, b, y, own_scratchpad());
#else
    dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(x, w, b, y), own_scratchpad(), cpu());
#endif
    slot.reset(new Matmul{pd, dnnl::matmul(pd)});
  }
  return slot.get();
}

Conv* conv_for(const int64_t* d, memory::data_type src, memory::data_type dst) {
  // d: batch, h, w, in, kh, kw, out, out_h, out_w, stride_h, stride_w, pad_top, pad_left, pad_bottom, pad_right
  std::lock_guard<std::mutex> guard(cache_lock);
  std::string key = key_of({d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7], d[8], d[9], d[10], d[11], d[12], d[13],
                            d[14], int64_t(src), int64_t(dst)});
  auto& slot = convs[key];
  if (!slot) {
    memory::desc x({d[0], d[3], d[1], d[2]}, src, tag::nhwc), y({d[0], d[6], d[7], d[8]}, dst, tag::nhwc),
        w_any({d[6], d[3], d[4], d[5]}, src, tag::any), w_given({d[6], d[3], d[4], d[5]}, src, tag::hwio),
        b({d[6]}, memory::data_type::f32, tag::a);
    memory::dims strides{d[9], d[10]}, pad_l{d[11], d[12]}, pad_r{d[13], d[14]};
#if DNNL_VERSION_MAJOR >= 3
    dnnl::convolution_forward::primitive_desc pd(cpu(), dnnl::prop_kind::forward_inference,
                                                 dnnl::algorithm::convolution_direct, x, w_any, b, y, strides, pad_l,
                                                 pad_r, own_scratchpad());
#else
    dnnl::convolution_forward::primitive_desc pd(
        dnnl::convolution_forward::desc(dnnl::prop_kind::forward_inference, dnnl::algorithm::convolution_direct, x,
                                        w_any, b, y, strides, pad_l, pad_r),
        own_scratchpad(), cpu());
#endif
    slot.reset(new Conv{pd, dnnl::convolution_forward(pd), w_given});
  }
  return slot.get();
}

ffi::Error failed(const char* what) { return ffi::Error(ffi::ErrorCode::kInternal, what); }

ffi::Error MatmulImpl(ffi::AnyBuffer x, ffi::AnyBuffer kernel, ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> out) {
  memory::data_type src, dst;
  if (!dtype_of(x.element_type(), &src) || !dtype_of(out->element_type(), &dst) ||
      kernel.element_type() != x.element_type() || bias.element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("onednn_matmul takes bf16 or f32 x and kernel alike, an f32 bias");
  auto dims = kernel.dimensions();
  if (dims.size() != 2) return ffi::Error::InvalidArgument("onednn_matmul's kernel is [K, N]");
  int64_t k = dims[0], n = dims[1], m = x.element_count() / k;
  try {
    Matmul* mm = matmul_for(m, k, n, src, dst);
    dnnl::stream stream(cpu());
    memory xm(mm->pd.src_desc(), cpu(), x.untyped_data()), wm(mm->pd.weights_desc(), cpu(), kernel.untyped_data()),
        bm(mm->pd.bias_desc(), cpu(), bias.untyped_data()), ym(mm->pd.dst_desc(), cpu(), out->untyped_data());
    memory scratch = scratchpad(mm->pd.scratchpad_desc());
    mm->primitive.execute(stream, {{DNNL_ARG_SRC, xm}, {DNNL_ARG_WEIGHTS, wm}, {DNNL_ARG_BIAS, bm}, {DNNL_ARG_DST, ym},
                                   {DNNL_ARG_SCRATCHPAD, scratch}});
    stream.wait();
  } catch (const dnnl::error& e) {
    return failed(e.what());
  }
  return ffi::Error::Success();
}

// x [B, M, K] @ y [B, K, N] -> [B, M, N], no bias: attention's products, one per (image, head).
ffi::Error BatchedMatmulImpl(ffi::AnyBuffer x, ffi::AnyBuffer y, ffi::Result<ffi::AnyBuffer> out) {
  memory::data_type src, dst;
  if (!dtype_of(x.element_type(), &src) || !dtype_of(out->element_type(), &dst) || y.element_type() != x.element_type())
    return ffi::Error::InvalidArgument("onednn_batched_matmul takes bf16 or f32 x and y alike");
  auto xd = x.dimensions(), yd = y.dimensions();
  if (xd.size() != 3 || yd.size() != 3 || xd[0] != yd[0] || xd[2] != yd[1])
    return ffi::Error::InvalidArgument("onednn_batched_matmul takes x [B, M, K] and y [B, K, N]");
  try {
    BatchedMatmul* mm = batched_for(xd[0], xd[1], xd[2], yd[2], src, dst);
    dnnl::stream stream(cpu());
    memory xm(mm->pd.src_desc(), cpu(), x.untyped_data()), wm(mm->pd.weights_desc(), cpu(), y.untyped_data()),
        ym(mm->pd.dst_desc(), cpu(), out->untyped_data());
    memory scratch = scratchpad(mm->pd.scratchpad_desc());
    mm->primitive.execute(stream, {{DNNL_ARG_SRC, xm}, {DNNL_ARG_WEIGHTS, wm}, {DNNL_ARG_DST, ym},
                                   {DNNL_ARG_SCRATCHPAD, scratch}});
    stream.wait();
  } catch (const dnnl::error& e) {
    return failed(e.what());
  }
  return ffi::Error::Success();
}

ffi::Error ConvImpl(ffi::AnyBuffer x, ffi::AnyBuffer kernel, ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> out,
                    ffi::Span<const int64_t> strides, ffi::Span<const int64_t> padding) {
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
    Conv* c = conv_for(d, src, dst);
    dnnl::stream stream(cpu());
    memory given(c->given_kernel, cpu(), kernel.untyped_data());
    memory wm = given;
    if (c->pd.weights_desc() != c->given_kernel) {
      wm = memory(c->pd.weights_desc(), cpu(), kernel_buffer.at_least(c->pd.weights_desc().get_size()));
      dnnl::reorder(given, wm).execute(stream, given, wm);
    }
    memory xm(c->pd.src_desc(), cpu(), x.untyped_data()), bm(c->pd.bias_desc(), cpu(), bias.untyped_data()),
        ym(c->pd.dst_desc(), cpu(), out->untyped_data());
    memory scratch = scratchpad(c->pd.scratchpad_desc());
    c->primitive.execute(stream, {{DNNL_ARG_SRC, xm}, {DNNL_ARG_WEIGHTS, wm}, {DNNL_ARG_BIAS, bm}, {DNNL_ARG_DST, ym},
                                  {DNNL_ARG_SCRATCHPAD, scratch}});
    stream.wait();
  } catch (const dnnl::error& e) {
    return failed(e.what());
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(OnednnMatmul, MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(OnednnBatchedMatmul, BatchedMatmulImpl,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(OnednnConv, ConvImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<ffi::Span<const int64_t>>("strides")
                                  .Attr<ffi::Span<const int64_t>>("padding"));
