// What the oneDNN handlers share (onednn.cc: matrix products, convolutions; kept.cc: pinned kernels; attention.cc;
// int8.cc): the CPU engine, per-thread reusable buffers, scratchpads, the cache of primitives built once per shape.
#pragma once

#include <oneapi/dnnl/dnnl.hpp>

#include <cstdint>
#include <cstdlib>
#include <functional>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "xla/ffi/api/ffi.h"

namespace jax_sd {

dnnl::engine& cpu();

// Each call brings its own scratchpad: with the library's shared one, a primitive must not run on two threads at
// once, and XLA runs a program's partitions (the engine's devices) on threads of their own.
dnnl::primitive_attr own_scratchpad();

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

// A scratchpad of `desc`'s size in this thread's reusable buffer.
dnnl::memory scratchpad(const dnnl::memory::desc& desc);

std::string key_of(std::initializer_list<int64_t> values);

extern std::mutex cache_lock;

// The primitive kept for `key`, made by `make` the first time it is asked for.
template <class T, class Make>
T* cached(std::unordered_map<std::string, std::unique_ptr<T>>& cache, const std::string& key, Make make) {
  std::lock_guard<std::mutex> guard(cache_lock);
  auto& slot = cache[key];
  if (!slot) slot.reset(make());
  return slot.get();
}

// A matmul's primitive descriptor in either oneDNN API (bias optional; `attr`: our scratchpad and any post-ops).
dnnl::matmul::primitive_desc matmul_pd(const dnnl::memory::desc& x, const dnnl::memory::desc& w,
                                       const dnnl::memory::desc* bias, const dnnl::memory::desc& y,
                                       const dnnl::primitive_attr& attr = own_scratchpad());

xla::ffi::Error failed(const char* what);

// kept.cc. `size` bytes (at least 64), 64-byte aligned, freed with the last copy of the pointer.
std::shared_ptr<void> aligned_block(size_t size);

// The kernel at `buffer` (`bytes` long) in the layout `want`, written by `fill` the first time this layout
// (and `variant`: 0 for the kernel itself, else a kernel derived from it) is asked for and kept; null where the buffer
// is not pinned (`OnednnPin`), and the caller prepares it itself.
std::shared_ptr<void> kept(const void* buffer, size_t bytes, const dnnl::memory::desc& want, int variant,
                           const std::function<void(dnnl::memory&)>& fill);

// The kernel at `buffer` (laid out as `given`) reordered into `want` at its first call and kept where the buffer is
// pinned, else null (the caller reorders it into a buffer of its own).
std::shared_ptr<void> kept(const void* buffer, size_t bytes, const dnnl::memory::desc& given,
                           const dnnl::memory::desc& want, dnnl::stream& stream);

}  // namespace jax_sd
