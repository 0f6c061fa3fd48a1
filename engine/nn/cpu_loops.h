// The vector loops of our own that the oneDNN handlers share (cpu_loops.cc): bf16 rounding and attention's softmax
// (bf16 weights, or f32 in place).
#pragma once

#include <xmmintrin.h>

#include <cstdint>
#include <cstring>

namespace jax_sd {

// Flushes denormal results to zero and reads denormal inputs as zero on this thread while in scope (the MXCSR's FTZ
// and DAZ bits), as XLA's own CPU threads run; oneDNN's OpenMP threads otherwise keep the default. Attention needs
// it: the weights of keys far below a row's maximum (down to 2^-126) times v underflow, and each denormal product
// costs a slow path: SD-shaped attention with wide logits ran 40% longer without it on a Zen 3.
class FlushDenormals {
 public:
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040u); }
  ~FlushDenormals() { _mm_setcsr(saved_); }
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;

 private:
  unsigned saved_;
};

inline uint16_t to_bf16(float x) {  // round to nearest even, as XLA's and oneDNN's conversions
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  return uint16_t((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

// One chunk of m keys of each row of logits [rows, m] -> unnormalised bf16 weights exp((x - top) * scale), online:
// `tops` holds each row's maximum over its chunks so far (-inf before the first; updated), `sums` their weights' sum
// in f32 (0 before the first; rescaled and added to), and `rescale` gets what the row's earlier weights must be
// multiplied by, its maximum having grown (exp((old - new) * scale); 0 at the first chunk).
void softmax_rows(const float* logits, uint16_t* weights, float* tops, float* sums, float* rescale, int64_t rows,
                  int64_t m, float scale);

// The same in f32, in place: each row of logits [rows, m] becomes its unnormalised weights exp((x - max) * scale)
// (AVX2 where f32_loops_avx2, else plain C++).
void softmax_rows_f32(float* logits, float* sums, int64_t rows, int64_t m, float scale);

// Whether the f32 loops run in AVX2 here: the CPU has it and ONEDNN_MAX_CPU_ISA lets oneDNN use it, so that a capped
// process measures the class it is capped to.
bool f32_loops_avx2();

// Whether oneDNN may use AMX here (bf16 and int8 tiles): the CPU has it and ONEDNN_MAX_CPU_ISA lets oneDNN use it.
bool amx_allowed();

// q k^T in f32, only where f32_loops_avx2 (it is AVX2 code; elsewhere attention takes oneDNN's logits): each
// (image, head)'s keys k [m, d] (rows `stride` floats apart) packed once into panels of kPanelKeys keys, each
// [d][kPanelKeys] with zeros past m (key_panels_size floats), then the logits [rows, m] of a block of contiguous
// queries q [rows, d] against them.
constexpr int64_t kPanelKeys = 16;
int64_t key_panels_size(int64_t m, int64_t d);
void pack_key_panels(const float* k, int64_t stride, int64_t m, int64_t d, float* panels);
void logits_f32(const float* q, int64_t rows, int64_t d, const float* panels, int64_t m, float* logits);

}  // namespace jax_sd
