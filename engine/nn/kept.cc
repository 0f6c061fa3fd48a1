// Kernels reordered once into the layouts oneDNN's primitives pick, kept for as long as their buffers are pinned
// (onednn.py's `pin`), in memory mapped for huge pages: what onednn.cc's, attention's and int8.cc's calls share.
#include <oneapi/dnnl/dnnl.hpp>
#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "onednn.h"

using dnnl::memory;

namespace jax_sd {
namespace {

// Kernels reordered once. A convolution's kernel arrives as HWIO and oneDNN wants its own blocked layout; the
// reorder costs as much memory traffic as the convolution's own read of the kernel (SD-Turbo's UNet: 0.1 s of a
// 1.2 s step). A kernel is reordered once and kept only where its buffer was pinned (`OnednnPin`): the caller
// holds that array alive and unchanged until it unpins it, so the address and byte size name its contents.
std::mutex packed_lock;
std::unordered_map<const void*, size_t> pinned;  // buffer -> its byte size
struct Reordered {
  memory::desc layout;
  int variant;  // 0: the kernel itself; else one derived from it (an upsampling convolution's phase kernels)
  std::shared_ptr<void> data;
};
// buffer -> its reordered copies, one per layout asked for (shapes that pick the same layout share one)
std::unordered_map<const void*, std::vector<Reordered>> packed;

constexpr size_t kHugePage = size_t(2) << 20, kPage = 4096;

size_t whole_pages(size_t size) { return (size + kPage - 1) / kPage * kPage; }

// A kept kernel's block: where it spans a 2 MB page, its own mapping starting on a 2 MB boundary, which
// `advise_huge_pages` marks for transparent huge pages once filled. Why: a step reads every kept kernel once, from
// memory (SD-Turbo's UNet 1.7 GB, its text encoder 0.6 GB), and with 4 KB pages each 4 KB costs a TLB miss, a
// two-level page walk in a VM. Measured on 2 cores of an Intel Xeon VM with AMX, the blocks advised from the start:
// the text encoder's 77-row products 93 -> 63 ms a picture; but the first picture after a start then took 6.8 s
// instead of 5.1 (the fill's page faults compacting memory for 2 MB pages), so the advice waits for the fill and
// khugepaged collapses the pages in the background. The tail past the last whole 2 MB stays in 4 KB pages, so
// nothing is rounded up; smaller kernels keep `aligned_block`, as does a block whose mapping fails.
std::shared_ptr<void> kept_block(size_t size) {
  if (size < kHugePage) return aligned_block(size);
  const size_t length = whole_pages(size);
  void* mapped = mmap(nullptr, length + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mapped == MAP_FAILED) return aligned_block(size);
  uintptr_t start = uintptr_t(mapped), aligned = (start + kHugePage - 1) / kHugePage * kHugePage;
  if (aligned > start) munmap(mapped, aligned - start);
  if (start + kHugePage > aligned) munmap(reinterpret_cast<void*>(aligned + length), start + kHugePage - aligned);
  void* block = reinterpret_cast<void*>(aligned);
  return std::shared_ptr<void>(block, [length](void* p) { munmap(p, length); });
}

// Advises transparent huge pages for a filled kept block from `kept_block`'s own mapping (2 MB-aligned, at least
// 2 MB): the kernel's khugepaged then moves its 4 KB pages into 2 MB ones in the background. Advised before the
// fill, the fill's page faults would compact memory for 2 MB pages on the spot.
void advise_huge_pages(void* block, size_t size) {
  if (size >= kHugePage && uintptr_t(block) % kHugePage == 0)
    madvise(block, whole_pages(size), MADV_HUGEPAGE);  // advice only: refused, nothing changes
}

}  // namespace

std::shared_ptr<void> aligned_block(size_t size) {
  return std::shared_ptr<void>(std::aligned_alloc(64, (std::max<size_t>(size, 64) + 63) / 64 * 64), std::free);
}

std::shared_ptr<void> kept(const void* buffer, size_t bytes, const memory::desc& want, int variant,
                           const std::function<void(memory&)>& fill) {
  std::lock_guard<std::mutex> guard(packed_lock);  // held through a first fill only: once per pinned kernel
  auto pin = pinned.find(buffer);
  if (pin == pinned.end() || pin->second != bytes) return nullptr;
  auto& copies = packed[buffer];
  for (const Reordered& copy : copies)
    if (copy.layout == want && copy.variant == variant) return copy.data;
  auto block = kept_block(want.get_size());
  memory to(want, cpu(), block.get());
  fill(to);
  advise_huge_pages(block.get(), want.get_size());
  copies.push_back(Reordered{want, variant, block});
  return block;
}

std::shared_ptr<void> kept(const void* buffer, size_t bytes, const memory::desc& given, const memory::desc& want,
                           dnnl::stream& stream) {
  return kept(buffer, bytes, want, 0, [&](memory& to) {
    memory from(given, cpu(), const_cast<void*>(buffer));
    dnnl::reorder(from, to).execute(stream, from, to);
    stream.wait();
  });
}

// The C entry points onednn.py calls (C linkage: the namespace does not change their names).

// The caller promises that each of these `count` buffers (with its byte size) stays allocated and unchanged until
// it unpins it: the convolution and matmul kernels they hold are kept reordered from their first call on.
extern "C" void OnednnPin(const void* const* buffers, const int64_t* sizes, int64_t count) {
  std::lock_guard<std::mutex> guard(packed_lock);
  for (int64_t i = 0; i < count; ++i) pinned[buffers[i]] = size_t(sizes[i]);
}

// Forgets these buffers and frees their reordered kernels (a call still reading one keeps it until it returns).
extern "C" void OnednnUnpin(const void* const* buffers, int64_t count) {
  std::lock_guard<std::mutex> guard(packed_lock);
  for (int64_t i = 0; i < count; ++i) {
    pinned.erase(buffers[i]);
    packed.erase(buffers[i]);
  }
}

// Bytes held by reordered kernels: what pinning costs.
extern "C" int64_t OnednnPackedBytes() {
  std::lock_guard<std::mutex> guard(packed_lock);
  int64_t total = 0;
  for (auto& [buffer, copies] : packed)
    for (const Reordered& copy : copies) total += int64_t(copy.layout.get_size());
  return total;
}

}  // namespace jax_sd
