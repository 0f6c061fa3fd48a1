// The vector loops of our own that the oneDNN handlers share (cpu_loops.cc): bf16 rounding and attention's softmax
// (bf16 weights, or f32 in place).
#pragma once

#include <cstdint>
#include <cstring>

namespace jax_sd {

inline uint16_t to_bf16(float x) {  // round to nearest even, as XLA's and oneDNN's conversions
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  return uint16_t((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

// Each row of logits [rows, m] -> unnormalised bf16 weights exp((x - max) * scale), and the rows' sums in f32.
void softmax_rows(const float* logits, uint16_t* weights, float* sums, int64_t rows, int64_t m, float scale);

// The same in f32, in place: each row of logits [rows, m] becomes its unnormalised weights exp((x - max) * scale).
void softmax_rows_f32(float* logits, float* sums, int64_t rows, int64_t m, float scale);

}  // namespace jax_sd
