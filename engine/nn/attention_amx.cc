// Attention's two products on AMX tiles (attention.cc calls them where `amx_tiles` holds): the logits of 16 queries
// against a chunk of keys, and the weighted sum of the chunk's values, each a run of TDPBF16PS over tiles of 16 rows
// by 64 bytes (bf16 pairs in, f32 sums out), between attention.cc's online softmax (softmax_rows).
//
// Why ours and not oneDNN's matmul: oneDNN 3.2 runs a 256-query block's logits (256 x 64 by 64 x 4096, f32 out) at
// about 0.4 TFLOP/s on an AMX core pair, and those f32 logits (4 MB a block) leave the L2 before the softmax reads
// them; for 1024 or 2048 keys, or fewer than 256 queries, it takes its AVX-512 kernels. Here 16 queries at a time
// meet a chunk of up to kAmxKeys keys, so the logits (32 KB) and the weights stay in the L1 and L2, and both
// products run on tiles whatever the lengths. The keys and values are packed once per (image, head) into the tiles'
// B layout (pairs of rows interleaved, zeros past the last key and the head's width), the head's width padded to 32
// (SD 1.x's 40 takes 64): zero columns add nothing to a logit, and a padded value column is never read back.
// Measured on 2 cores of an Intel Xeon VM with AMX, SD 2.1's 4096-token self-attention (5 heads of 64) alone
// 33.3 -> 25-28 ms, its 77-key cross-attention 1.07 -> 0.26 ms, 1024 tokens (10 heads) 5.0 -> 3.7-4.0 ms.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "attention_amx.h"
#include "cpu_loops.h"

// AMX intrinsics came with GCC 11 and Clang 12; an older compiler builds the rest of the library, and attention
// keeps oneDNN's products (amx_tiles is false).
#if (defined(__clang__) && __has_include(<amxintrin.h>)) || (!defined(__clang__) && __has_include(<amxtileintrin.h>))
#define JAX_SD_AMX_INTRINSICS 1
#else
#define JAX_SD_AMX_INTRINSICS 0
#endif

namespace jax_sd {

namespace {

constexpr int kTileRows = 16;         // rows of every tile; a B tile's rows are pairs of its K dimension
constexpr int kTileBytes = 64;        // bytes of a tile's row: 32 bf16, or 16 f32
constexpr int64_t kPairCols = 16;     // columns of a B tile (each a pair of bf16)
constexpr int64_t kDepth = 32;        // the K dimension one TDPBF16PS takes
constexpr int64_t kTileElems = 512;   // bf16 elements of a B tile (16 rows x 32)

#if JAX_SD_AMX_INTRINSICS
// The tile configuration: palette 1, all eight tiles 16 rows of 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

__attribute__((target("amx-tile"))) void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = kTileBytes;
    config.rows[t] = kTileRows;
  }
  _tile_loadconfig(&config);
}

#endif
}  // namespace

bool amx_tiles() {
  // Linux hands out the tiles' state only to a process that asks (ARCH_REQ_XCOMP_PERM for XTILEDATA).
  static const bool ready = JAX_SD_AMX_INTRINSICS && amx_allowed() && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ready;
}

int64_t amx_width(int64_t d) { return (d + kDepth - 1) / kDepth * kDepth; }

int64_t amx_chunk(int64_t m) { return std::min(kAmxKeys, (m + kDepth - 1) / kDepth * kDepth); }

int64_t amx_chunks(int64_t m) { return (m + amx_chunk(m) - 1) / amx_chunk(m); }

int64_t amx_packed_size(int64_t m, int64_t d) {
  return 2 * amx_chunks(m) * amx_chunk(m) * amx_width(d);
}

void amx_pack(const uint16_t* k, const uint16_t* v, int64_t stride, int64_t m, int64_t d, uint16_t* packed) {
  // Each chunk's keys and values are first copied into rows of `width` with zeros past d and past m; then, as 32-bit
  // words (a bf16 pair each), keys' tile (key group g, depth step s) [p][c] is key 16g + c's pair 16s + p (the
  // logits' B operand k^T, its rows pairs of the head's width), and values' tile (column group t, key step s) [p][c]
  // is column 16t + c of keys 32s + 2p and 32s + 2p + 1 (the weighted sum's B operand v, its rows pairs of keys).
  const int64_t width = amx_width(d), chunk = amx_chunk(m), chunks = amx_chunks(m);
  const int64_t depth_tiles = width / kDepth, steps = chunk / kDepth, column_tiles = width / kPairCols;
  thread_local std::vector<uint16_t> rows;
  rows.resize(2 * chunk * width);
  uint16_t *key_rows = rows.data(), *value_rows = rows.data() + chunk * width;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t first = c * chunk, count = std::min(chunk, m - first);
    std::fill(rows.begin(), rows.end(), uint16_t(0));
    for (int64_t j = 0; j < count; ++j) {
      std::memcpy(key_rows + j * width, k + (first + j) * stride, d * 2);
      std::memcpy(value_rows + j * width, v + (first + j) * stride, d * 2);
    }
    uint32_t* keys = reinterpret_cast<uint32_t*>(packed + first * width);
    const uint32_t* key_pairs = reinterpret_cast<const uint32_t*>(key_rows);
    for (int64_t g = 0; g < chunk / kPairCols; ++g)
      for (int64_t s = 0; s < depth_tiles; ++s) {
        uint32_t* tile = keys + (g * depth_tiles + s) * (kTileElems / 2);
        for (int64_t c2 = 0; c2 < kPairCols; ++c2)
          for (int64_t p = 0; p < kTileRows; ++p)
            tile[p * kPairCols + c2] = key_pairs[(g * kPairCols + c2) * (width / 2) + s * kTileRows + p];
      }
    uint32_t* values = reinterpret_cast<uint32_t*>(packed + (chunks + c) * chunk * width);
    for (int64_t t = 0; t < column_tiles; ++t)
      for (int64_t s = 0; s < steps; ++s) {
        uint32_t* tile = values + (t * steps + s) * (kTileElems / 2);
        for (int64_t p = 0; p < kTileRows; ++p) {
          const uint16_t* even = value_rows + (s * kDepth + 2 * p) * width + t * kPairCols;
          const uint16_t* odd = even + width;
          for (int64_t c2 = 0; c2 < kPairCols; ++c2) tile[p * kPairCols + c2] = even[c2] | uint32_t(odd[c2]) << 16;
        }
      }
  }
}

#if JAX_SD_AMX_INTRINSICS
namespace {

// out [16, 16 * groups] f32 (rows `out_stride` floats apart) = a [16, 32 * steps] bf16 (rows `a_stride` elements
// apart) times the B tiles at `b` (group t's step s at t * steps + s), two groups of 16 columns at a time into tiles
// 0 and 1; tile 2 holds a's step, tiles 3 and 4 the groups'. `groups` is even.
__attribute__((target("amx-tile,amx-bf16"))) void tile_products(const uint16_t* a, int64_t a_stride, int64_t steps,
                                                                 const uint16_t* b, int64_t groups, float* out,
                                                                 int64_t out_stride) {
  configure_tiles();
  for (int64_t t = 0; t < groups; t += 2) {
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t s = 0; s < steps; ++s) {
      _tile_loadd(2, a + s * kDepth, a_stride * 2);
      _tile_loadd(3, b + (t * steps + s) * kTileElems, kTileBytes);
      _tile_loadd(4, b + ((t + 1) * steps + s) * kTileElems, kTileBytes);
      _tile_dpbf16ps(0, 2, 3);
      _tile_dpbf16ps(1, 2, 4);
    }
    _tile_stored(0, out + t * kPairCols, out_stride * 4);
    _tile_stored(1, out + (t + 1) * kPairCols, out_stride * 4);
  }
  _tile_release();
}

}  // namespace

void amx_logits(const uint16_t* q, int64_t d, const uint16_t* packed, int64_t m, int64_t c, float* logits) {
  const int64_t width = amx_width(d), chunk = amx_chunk(m);
  tile_products(q, width, width / kDepth, packed + c * chunk * width, chunk / kPairCols, logits, chunk);
}

void amx_weighted_sum(const uint16_t* weights, int64_t d, const uint16_t* packed, int64_t m, int64_t c, float* out) {
  const int64_t width = amx_width(d), chunk = amx_chunk(m), chunks = amx_chunks(m);
  tile_products(weights, chunk, chunk / kDepth, packed + (chunks + c) * chunk * width, width / kPairCols, out, width);
}

#else
void amx_logits(const uint16_t*, int64_t, const uint16_t*, int64_t, int64_t, float*) {}  // unreached: no amx_tiles
void amx_weighted_sum(const uint16_t*, int64_t, const uint16_t*, int64_t, int64_t, float*) {}
#endif

}  // namespace jax_sd
