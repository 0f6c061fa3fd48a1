// int8 convolutions as an XLA FFI handler (engine/nn/int8.py): u8 activations times s8 weights, summed exactly in s32.
//
// Why: on a CPU without native bf16 (Zen 2/3, Intel Core: AVX2 only), f32 is what XLA and oneDNN compute in, at
// about a third of these cores' peak for SD's 3x3 convolutions. AVX2's vpmaddubsw multiplies 32 u8 x s8 pairs and
// adds neighbours into s16 in one instruction (vpmaddwd then widens to s32): twice f32's multiply-adds per cycle, on
// a quarter of the bytes. oneDNN's int8 JIT kernels (jit_uni_int8 on AVX2, VNNI's vpdpbusd where the CPU has it)
// run SD-Turbo's 64x64 320->320 3x3 convolution at about twice XLA's f32 rate on a Zen 3 (bench/kernels_int8.py).
// A linear layer is the same call as a 1x1 convolution over its tokens: oneDNN's int8 matmul on AVX2 goes through
// its gemm and measured slower than its 1x1 convolution kernel.
//
// What it computes: out[n, y, x, o] = sum over (i, j, c) of x[n, y*sh + i, x*sw + j, c] * kernel[i, j, c, o], no
// padding (the caller pads with the activations' zero point), exactly in s32. Exactness needs the u8 x s8 pair
// sums of vpmaddubsw not to saturate s16: the caller keeps weights within [-63, 63] (2 * 255 * 63 < 32767).
// Layouts: x NHWC u8, kernel HWIO s8 (flax's), out NHWC s32. The kernel is reordered into oneDNN's blocked layout
// at every call unless its buffer is pinned (onednn.py's `pin`), when the reordered copy is kept.
#include <oneapi/dnnl/dnnl.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>

#include "onednn.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using dnnl::memory;
using tag = dnnl::memory::format_tag;

namespace {

using namespace jax_sd;

struct Int8Conv {
  dnnl::convolution_forward::primitive_desc pd;
  dnnl::convolution_forward primitive;
  memory::desc given_kernel;  // HWIO s8 as it arrives
};

std::unordered_map<std::string, std::unique_ptr<Int8Conv>> int8_convs;
thread_local Buffer int8_kernel_buffer;

// d: batch, h, w, in, kh, kw, out, out_h, out_w, stride_h, stride_w
Int8Conv* int8_conv_for(const int64_t* d) {
  std::string key = key_of({d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7], d[8], d[9], d[10]});
  return cached(int8_convs, key, [&] {
    memory::desc x({d[0], d[3], d[1], d[2]}, memory::data_type::u8, tag::nhwc),
        y({d[0], d[6], d[7], d[8]}, memory::data_type::s32, tag::nhwc),
        w_any({d[6], d[3], d[4], d[5]}, memory::data_type::s8, tag::any),
        w_given({d[6], d[3], d[4], d[5]}, memory::data_type::s8, tag::hwio);
    memory::dims strides{d[9], d[10]}, pad{0, 0};
#if DNNL_VERSION_MAJOR >= 3
    dnnl::convolution_forward::primitive_desc pd(cpu(), dnnl::prop_kind::forward_inference,
                                                 dnnl::algorithm::convolution_direct, x, w_any, y, strides, pad, pad,
                                                 own_scratchpad());
#else
    dnnl::convolution_forward::primitive_desc pd(
        dnnl::convolution_forward::desc(dnnl::prop_kind::forward_inference, dnnl::algorithm::convolution_direct, x,
                                        w_any, y, strides, pad, pad),
        own_scratchpad(), cpu());
#endif
    return new Int8Conv{pd, dnnl::convolution_forward(pd), w_given};
  });
}

ffi::Error Int8ConvImpl(ffi::AnyBuffer x, ffi::AnyBuffer kernel, ffi::Result<ffi::AnyBuffer> out,
                        ffi::Span<const int64_t> strides) {
  if (x.element_type() != ffi::DataType::U8 || kernel.element_type() != ffi::DataType::S8 ||
      out->element_type() != ffi::DataType::S32)
    return ffi::Error::InvalidArgument("onednn_int8_conv takes u8 x, an s8 kernel, and gives s32");
  auto xd = x.dimensions(), kd = kernel.dimensions(), yd = out->dimensions();
  if (xd.size() != 4 || kd.size() != 4 || yd.size() != 4 || strides.size() != 2 || strides[0] < 1 || strides[1] < 1)
    return ffi::Error::InvalidArgument("onednn_int8_conv takes NHWC x, an HWIO kernel, NHWC out, 2 strides");
  if (kd[2] != xd[3] || yd[0] != xd[0] || yd[3] != kd[3] || xd[1] < kd[0] || xd[2] < kd[1] ||
      yd[1] != (xd[1] - kd[0]) / strides[0] + 1 || yd[2] != (xd[2] - kd[1]) / strides[1] + 1)
    return ffi::Error::InvalidArgument("onednn_int8_conv's shapes disagree (x's channels, the unpadded output size)");
  int64_t d[11] = {xd[0], xd[1], xd[2], xd[3], kd[0], kd[1], kd[3], yd[1], yd[2], strides[0], strides[1]};
  try {
    Int8Conv* c = int8_conv_for(d);
    dnnl::stream stream(cpu());
    memory given(c->given_kernel, cpu(), kernel.untyped_data());
    memory wm = given;
    std::shared_ptr<void> weights;  // a pinned kernel's, reordered once and held while this call reads it
    if (c->pd.weights_desc() != c->given_kernel) {
      weights = kept(kernel.untyped_data(), kernel.size_bytes(), c->given_kernel, c->pd.weights_desc(),
                               stream);
      wm = memory(c->pd.weights_desc(), cpu(),
                  weights ? weights.get() : int8_kernel_buffer.at_least(c->pd.weights_desc().get_size()));
      if (!weights) dnnl::reorder(given, wm).execute(stream, given, wm);
    }
    memory xm(c->pd.src_desc(), cpu(), x.untyped_data()), ym(c->pd.dst_desc(), cpu(), out->untyped_data());
    memory scratch = scratchpad(c->pd.scratchpad_desc());
    c->primitive.execute(stream, {{DNNL_ARG_SRC, xm}, {DNNL_ARG_WEIGHTS, wm}, {DNNL_ARG_DST, ym},
                                  {DNNL_ARG_SCRATCHPAD, scratch}});
    stream.wait();
  } catch (const dnnl::error& e) {
    return failed(e.what());
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(OnednnInt8Conv, Int8ConvImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<ffi::Span<const int64_t>>("strides"));
