// Attention's two products on AMX tiles (attention_amx.cc), for attention.cc's bf16 path where `amx_tiles` holds.
#pragma once

#include <cstdint>

namespace jax_sd {

// The most keys one chunk of the online softmax takes: 16 queries' f32 logits are then 32 KB.
constexpr int64_t kAmxKeys = 512;
// The widest head the packing takes (its width padded to 32).
constexpr int64_t kAmxMaxWidth = 256;

// Whether attention's products run on AMX tiles here: amx_allowed, and Linux gave this process the tiles' state.
bool amx_tiles();

// A head's width d padded to the tiles' depth (32), and the keys of one chunk for m keys (at most kAmxKeys, a
// multiple of 32); a query block's rows are 16, its queries [16, amx_width(d)] bf16 with zeros past d.
int64_t amx_width(int64_t d);
int64_t amx_chunk(int64_t m);
int64_t amx_chunks(int64_t m);  // chunks of amx_chunk(m) keys, the last one short

// bf16 elements of one (image, head)'s packed keys and values (amx_pack).
int64_t amx_packed_size(int64_t m, int64_t d);

// k and v [m, d] (bf16, rows `stride` elements apart) packed for amx_logits and amx_weighted_sum.
void amx_pack(const uint16_t* k, const uint16_t* v, int64_t stride, int64_t m, int64_t d, uint16_t* packed);

// The f32 logits [16, amx_chunk(m)] of 16 queries q against chunk `c` of the packed keys (unscaled; past the last
// key, 0).
void amx_logits(const uint16_t* q, int64_t d, const uint16_t* packed, int64_t m, int64_t c, float* logits);

// out [16, amx_width(d)] f32 = weights [16, amx_chunk(m)] (bf16, zeros past the last key) times chunk `c` of the
// packed values.
void amx_weighted_sum(const uint16_t* weights, int64_t d, const uint16_t* packed, int64_t m, int64_t c, float* out);

}  // namespace jax_sd
