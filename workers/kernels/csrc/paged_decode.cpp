// Paged decode attention for CPUs: one query token per sequence over its cached K/V, read from
// the blocks in place. Each thread takes a share of the step's positions: whole sequences, and
// parts of whole blocks of a long one, merged after. A sequence's (or part's) K rows are read
// once, in order, for all heads (pass 1: scores), then its V rows likewise (pass 2: the
// weighted sum).
// - Pass 1 sums each head's dot product with a row across the vector's lanes (`scores` = 0), or,
//   with `scores` = 1 (vector tiles), keeps the vectors of partial sums and sums them L positions
//   at a time (`sums`), a third of the shuffles; there, with AVX512-BF16, bf16 rows meet bf16 q
//   in the CPU's pair dot-product instruction, unwidened. Tiles cut bf16 attention on an AMD EPYC
//   (Zen 5); on an Intel Xeon with AMX, tiles and pairs each measured slower: the caller measures
//   which.
// - With `scores` = 3 (bf16 with AVX512-BF16), K is laid out in pairs within each block
//   ([kv_heads, dim / 2, block_size, 2]: see k_pair_at; the caller stores it so), where one
//   64-byte vector holds 16 positions' values of one pair of a head's dims, the shape the pair
//   product takes: pass 1 multiplies it by that pair of each query head, broadcast, and has 16
//   positions' scores with no sum across lanes. On an AMD EPYC (Zen 4) that cut bf16 attention
//   at 32 streams by a fifth from memory and by a third in cache: the caller measures which.
// - With `scores` = 2 (bf16 with AMX), K is in pairs as for 3, which is the layout a tile's B
//   operand takes: pass 1 multiplies a KV head's query heads (A) by 16 positions' K (B) on the
//   CPU's tile unit, 32 values a step, and stores each head's 16 scores straight from the C tile.
//   On an Intel Xeon with AMX that cut bf16 attention at 32 streams by a sixth from memory and by
//   two-fifths in cache against the pair products (shapes the tiles do not fit take those).
// - With `scores` = 4 (bf16 with AMX), pass 1 is 2's, and V is laid out in pairs of positions
//   within each block ([kv_heads, block_size / 2, dim, 2]: see v_pair_at; the caller stores it
//   so), the B operand's layout for the weighted sum: pass 2 multiplies 16 positions' weights of
//   every query head (A, rounded to bf16) by their V (B), 16 dims a tile, on the tile unit too
//   (windows of up to 16 query heads, passes of up to 64 dims; any shape 2 takes).
// - Pass 2 adds `v_rows` (1 or 4) rows into each accumulator per load and store of it. Four cut
//   bf16 attention by a fifth on an AMD EPYC (Zen 5) and slowed fp32 there by a tenth, whose rows
//   are twice as long: the caller measures which.
// - With `ahead` > 0 each row is asked for that many rows before its use: K's rows, then V's,
//   then the next sequence's K (on an Intel Xeon the hardware's prefetcher alone kept the rows
//   arriving at about half the rate a plain sum reads memory; on an AMD EPYC (Zen 3) asking ahead
//   was slower: the caller measures which). `hint` says how: into every cache level (prefetcht0),
//   into L2 (prefetcht1) or as data read once (prefetchnta). On the Zen 5 prefetchnta was up to
//   a fifth faster than prefetcht0 with 4 V rows per pass; on an Intel Xeon with AMX prefetcht1
//   and prefetcht0 came within a few percent of each other.
// Accumulation is in float whatever the cache's dtype. Vectors are vec.h's: their width is set by
// the flags the extension is compiled with (-march=native: AVX-512, AVX2, or plain C++).
#include "vec.h"
#include "amx.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t MAX_CHUNKS = 16;  // head_dim <= 16 vectors: 256 with AVX-512, 128 with AVX2
constexpr int64_t MAX_HEADS = 64;  // query heads per sequence
constexpr int64_t MAX_PARTS = 64;  // threads sharing a step (a sequence has a part in each at most)

struct Shape {
  int64_t heads, kv_heads, dim, block_size, table_width;
};

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
constexpr bool BF16_PAIRS = true;  // the CPU's bf16 pair dot product (vdpbf16ps)
#else
constexpr bool BF16_PAIRS = false;
#endif

// Where position `pos` of a sequence with block table `blocks` starts in a cache of rows of
// `row` values (every KV head of one token).
inline int64_t row_at(const int64_t* blocks, int64_t pos, const Shape& s, int64_t row) {
  return (blocks[pos / s.block_size] * s.block_size + pos % s.block_size) * row;
}

// Asks for the row of `row` values at `cache + at` to be brought in with `hint`, the prefetch's
// locality: 3 (prefetcht0: into every cache level), 2 (prefetcht1: into L2 and beyond) or 0
// (prefetchnta: as data read once). On x86, volatile asm rather than __builtin_prefetch: GCC 12
// (-O1 and up) counts a function of prefetch builtins alone as free of effects and drops every
// call to it.
#if defined(__x86_64__)
#define PREFETCH(insn, at) asm volatile(insn " %0" : : "m"(*(at)))
#else
#define PREFETCH(insn, at) __builtin_prefetch(at, 0, 3)
#endif
template <typename T>
inline void prefetch(const T* cache, int64_t at, int64_t row, int64_t hint) {
  const char* p = reinterpret_cast<const char*>(cache + at);
  for (int64_t b = 0; b < row * int64_t(sizeof(T)); b += 64) {
    if (hint == 0) {
      PREFETCH("prefetchnta", p + b);
    } else if (hint == 2) {
      PREFETCH("prefetcht1", p + b);
    } else {
      PREFETCH("prefetcht0", p + b);
    }
  }
}
#undef PREFETCH

// Pass 1's row `ahead` positions past `pos`: K's, then, past K's end, V's first ones.
template <typename T>
inline void ask_ahead_of_k(const T* kc, const T* vc, const int64_t* offs, int64_t pos,
                           int64_t len, int64_t ahead, int64_t row, int64_t hint) {
  if (ahead > 0 && pos + ahead < len) {
    prefetch(kc, offs[pos + ahead], row, hint);
  } else if (ahead > 0 && pos + ahead - len < len) {
    prefetch(vc, offs[pos + ahead - len], row, hint);
  }
}

// Pass 2's row `ahead` positions past `pos`: V's, then, past V's end, the first ones of the next
// sequence's K (its table `next_blocks`, its length `next_len`). Past `len` itself, none.
template <typename T>
inline void ask_ahead_of_v(const T* kc, const T* vc, const int64_t* offs, int64_t pos,
                           int64_t len, int64_t ahead, int64_t row, int64_t hint,
                           const int64_t* next_blocks, int64_t next_len, const Shape& s) {
  if (ahead > 0 && pos + ahead < len) {
    prefetch(vc, offs[pos + ahead], row, hint);
  } else if (ahead > 0 && pos < len && pos + ahead - len < next_len) {
    prefetch(kc, row_at(next_blocks, pos + ahead - len, s, row), row, hint);
  }
}

// The lane sums of L vectors as one vector, out[i] = sum(v[i]): pairwise shuffles and adds.
inline Vec sums(const Vec* v) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
  for (int i = 0; i < 2; ++i)
    d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88),
                       _mm512_shuffle_f32x4(d[0], d[1], 0xDD));
#elif defined(CPU_CAPABILITY_AVX2)
  __m256 b[4], c[2];
  for (int i = 0; i < 4; ++i)
    b[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 2; ++i)
    c[i] = _mm256_add_ps(_mm256_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                         _mm256_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
  return _mm256_add_ps(_mm256_permute2f128_ps(c[0], c[1], 0x20),
                       _mm256_permute2f128_ps(c[0], c[1], 0x31));
#else
  float out[L];
  for (int64_t i = 0; i < L; ++i) out[i] = sum(v[i]);
  return Vec::loadu(out);
#endif
}

// The calling thread's scratch: each position's row offset, each head's scores and one tile of
// its partial dot products, and each head's weighted sum of V.
struct Scratch {
  std::vector<int64_t> offs;  // [len]
  std::vector<float> scores, part, acc;  // [heads, len], [heads, L, L], [heads, chunks * L]
  std::vector<at::BFloat16> weights, tail;  // mode 4: [kv_heads, 16, 16] zeroed, [16 * dim]
};

// Where K's value (position o of a block, KV head h, dim d) sits within the block when K is laid
// out in pairs: [kv_heads, dim / 2, block_size, 2], so that 16 positions' values of one pair of
// a head's dims are one 64-byte vector, in the shape the pair product takes.
inline int64_t k_pair_at(int64_t o, int64_t h, int64_t d, const Shape& s) {
  return (h * s.dim + d - d % 2) * s.block_size + o * 2 + d % 2;
}

constexpr int64_t PAIR_POS = 16;  // positions per vector: 16 pairs of bf16
constexpr int64_t V_ROWS = 16;  // query heads a window of mode 4's weighted sum: a tile's rows

bool pairs_fit(const Shape& s) { return s.dim % 4 == 0 && s.block_size % PAIR_POS == 0; }

#if defined(PREFIXSERVE_AMX)
constexpr int64_t TILE_STEP = 32;  // values of a head per tile product

// Tile 0: C, a KV head's query heads' scores at 16 positions (a row each); 1: A, those heads' q,
// 32 values of the head; 2: B, the 16 positions' K for the same values (a row per pair of dims:
// K in pairs is the tile's own layout).
void configure_scores(int64_t group) {
  TileConfig c;
  c.rows[0] = c.rows[1] = uint8_t(group);
  c.rows[2] = 16;
  c.colsb[0] = c.colsb[1] = c.colsb[2] = 64;
  load_config(c);
}

bool amx_fits(const Shape& s) {
  return s.dim % TILE_STEP == 0 && s.heads / s.kv_heads <= 16 && pairs_fit(s);
}

// Pass 1 on AMX tiles over K in pairs: each block's positions 16 at a time, each KV head's query
// heads at once, 32 values a step, read in place; each C row (one head's 16 scores) is stored
// straight into `scores`, unscaled (the softmax scales them). Past `len`, the block's other
// positions are scored too and not kept.
void scores_amx(const at::BFloat16* kc, const at::BFloat16* vc, const int64_t* blocks,
                const int64_t* offs, int64_t len, const at::BFloat16* q, float scale,
                float* scores, const Shape& s, int64_t ahead, int64_t hint) {
  const int64_t group = s.heads / s.kv_heads, row = s.kv_heads * s.dim;
  alignas(64) float tail[16 * PAIR_POS];
  for (int64_t t = 0; t < len; t += PAIR_POS) {
    const int64_t n = std::min(PAIR_POS, len - t);
    for (int64_t pos = t; pos < t + n; ++pos)  // the blocks' bytes in order, as rows would be
      ask_ahead_of_k(kc, vc, offs, pos, len, ahead, row, hint);
    const at::BFloat16* base =
        kc + blocks[t / s.block_size] * s.block_size * row + (t % s.block_size) * 2;
    for (int64_t h = 0; h < s.kv_heads; ++h) {
      const at::BFloat16* k = base + h * s.dim * s.block_size;
      _tile_zero(0);
      for (int64_t step = 0; step < s.dim / TILE_STEP; ++step) {
        _tile_loadd(1, q + h * group * s.dim + step * TILE_STEP, s.dim * 2);
        _tile_loadd(2, k + step * TILE_STEP * s.block_size, s.block_size * 4);
        _tile_dpbf16ps(0, 1, 2);
      }
      float* out = scores + h * group * len + t;
      if (n == PAIR_POS) {
        _tile_stored(0, out, len * 4);
      } else {
        _tile_stored(0, tail, PAIR_POS * 4);
        for (int64_t j = 0; j < group; ++j)
          std::copy(tail + j * PAIR_POS, tail + j * PAIR_POS + n, out + j * len);
      }
    }
  }
}

constexpr int64_t V_CHUNKS = 4;  // result tiles of 16 dims: a pass takes 64 of a head's values

// Where V's value (position o of a block, KV head h, dim d) sits within the block in mode 4,
// which lays V out in pairs of positions, [kv_heads, block_size / 2, dim, 2]: a row of 16 dims
// of one pair of positions is the layout a tile's B operand takes. Any shape the scores' tiles
// take (amx_fits): windows of whole KV groups up to 16 query heads, passes of up to 64 dims.
inline int64_t v_pair_at(int64_t o, int64_t h, int64_t d, const Shape& s) {
  return ((h * s.block_size + o - o % 2) * s.dim + 2 * d) + o % 2;
}

// Tiles 0-3: C, a window's query heads' weighted sums at 16 dims (a row each); 4: A, those
// heads' weights at 16 positions, zero but in one KV head's group's rows; 5-6: B, V in pairs (8
// pairs of positions, 16 dims).
void configure_v_tiles(int64_t heads) {
  TileConfig c;
  for (int t = 0; t < V_CHUNKS; ++t) {
    c.rows[t] = uint8_t(heads);
    c.colsb[t] = 64;
  }
  c.rows[4] = uint8_t(heads);
  c.colsb[4] = 32;
  c.rows[5] = c.rows[6] = 8;
  c.colsb[5] = c.colsb[6] = 64;
  load_config(c);
}

// Pass 2 on AMX tiles over V in pairs, a window of whole KV groups (up to 16 query heads) and 64
// dims at a time: per 16 positions and KV head, the weights (`p`, [heads, len] floats, rounded to
// bf16 as HF's bf16 attention rounds them) times the positions' V, into all the window's heads'
// sums at once; a KV head's A rows are zero outside its group, so its product adds only to its
// own heads' rows. Rows past `len` in the last block are read from a zeroed copy (the weights
// there are 0, and the cache may hold anything). The first window's first pass asks for rows
// ahead as pass 2 of the other modes does (they bring in whole blocks). Leaves the sums in acc
// [heads, dim] and the scores' tiles configured.
void v_amx(const at::BFloat16* vc, const at::BFloat16* kc, const int64_t* blocks,
           const int64_t* offs, int64_t len, const float* p, float* acc, const Shape& s,
           at::BFloat16* weights, at::BFloat16* tail, int64_t ahead, int64_t hint,
           const int64_t* next_blocks, int64_t next_len) {
  const int64_t group = s.heads / s.kv_heads, row = s.kv_heads * s.dim;
  const int64_t per_window = V_ROWS / group;  // KV heads
  for (int64_t h0 = 0; h0 < s.kv_heads; h0 += per_window) {
    const int64_t h1 = std::min(s.kv_heads, h0 + per_window), r0 = h0 * group;
    configure_v_tiles((h1 - h0) * group);
    for (int64_t d0 = 0; d0 < s.dim; d0 += V_CHUNKS * 16) {
      const int64_t chunks = std::min(V_CHUNKS, (s.dim - d0) / 16);
      _tile_zero(0);  // tile ids are constants: one statement a tile
      if (chunks > 1) _tile_zero(1);
      if (chunks > 2) _tile_zero(2);
      if (chunks > 3) _tile_zero(3);
      for (int64_t t = 0; t < len; t += PAIR_POS) {
        const int64_t n = std::min(PAIR_POS, len - t);
        for (int64_t pos = t; h0 == 0 && d0 == 0 && pos < t + n; ++pos)
          ask_ahead_of_v(kc, vc, offs, pos, len, ahead, row, hint, next_blocks, next_len, s);
        for (int64_t r = r0; r < h1 * group; ++r) {  // head r's, in its KV head's tile
          at::BFloat16* w = weights + ((r / group) * V_ROWS + r - r0) * PAIR_POS;
          const float* src = p + r * len + t;
          if (n == PAIR_POS) {
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(w),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src)));
          } else {
            for (int64_t i = 0; i < PAIR_POS; ++i) w[i] = at::BFloat16(i < n ? src[i] : 0.f);
          }
        }
        const at::BFloat16* base =
            vc + blocks[t / s.block_size] * s.block_size * row + (t % s.block_size) * s.dim;
        for (int64_t h = h0; h < h1; ++h) {
          const at::BFloat16* v = base + h * s.block_size * s.dim;
          if (n < PAIR_POS) {  // positions past len: zeros, not whatever the block holds
            for (int64_t q = 0; q < PAIR_POS / 2; ++q) {  // a pair's row: 16 dims a vector
              // both positions, the first alone (even lanes), or neither
              const __mmask32 keep =
                  2 * q + 1 < n ? ~__mmask32(0) : 2 * q < n ? 0x55555555u : 0u;
              for (int64_t d = 0; d < 2 * s.dim; d += 32)
                _mm512_storeu_si512(tail + q * 2 * s.dim + d,
                                    _mm512_maskz_loadu_epi16(keep, v + q * 2 * s.dim + d));
            }
            v = tail;
          }
          v += d0 * 2;  // the pass's first dim, in pairs
          _tile_loadd(4, weights + h * V_ROWS * PAIR_POS, PAIR_POS * 2);
          _tile_loadd(5, v, s.dim * 4);
          _tile_dpbf16ps(0, 4, 5);
          if (chunks > 1) {
            _tile_loadd(6, v + 32, s.dim * 4);
            _tile_dpbf16ps(1, 4, 6);
          }
          if (chunks > 2) {
            _tile_loadd(5, v + 64, s.dim * 4);
            _tile_dpbf16ps(2, 4, 5);
          }
          if (chunks > 3) {
            _tile_loadd(6, v + 96, s.dim * 4);
            _tile_dpbf16ps(3, 4, 6);
          }
        }
      }
      float* out = acc + r0 * s.dim + d0;
      _tile_stored(0, out, s.dim * 4);
      if (chunks > 1) _tile_stored(1, out + 16, s.dim * 4);
      if (chunks > 2) _tile_stored(2, out + 32, s.dim * 4);
      if (chunks > 3) _tile_stored(3, out + 48, s.dim * 4);
    }
  }
  configure_scores(group);
}
#endif

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
constexpr int64_t MAX_GROUP = 8;  // query heads per pass (2 sums each in registers)

// G query heads' scores at 16 positions of one KV head: `k` the block's pairs of that head from
// the tile's first position, `q` the first query head's pairs; two sums per head (even and odd
// pairs) so that the adds do not wait on each other.
template <int64_t G>
inline void pair_scores(const at::BFloat16* k, const int32_t* q, int64_t q_step, int64_t pairs,
                        int64_t block_size, float scale, float* out, int64_t len, int64_t n) {
  __m512 a[G][2];
  for (int64_t j = 0; j < G; ++j) a[j][0] = a[j][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; p += 2) {
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(k + p * block_size * 2);
    const __m512bh k1 = (__m512bh)_mm512_loadu_si512(k + (p + 1) * block_size * 2);
    for (int64_t j = 0; j < G; ++j) {
      a[j][0] = _mm512_dpbf16_ps(a[j][0], (__m512bh)_mm512_set1_epi32(q[j * q_step + p]), k0);
      a[j][1] = _mm512_dpbf16_ps(a[j][1], (__m512bh)_mm512_set1_epi32(q[j * q_step + p + 1]), k1);
    }
  }
  const __mmask16 m = n == PAIR_POS ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
  for (int64_t j = 0; j < G; ++j)
    _mm512_mask_storeu_ps(out + j * len, m,
                          _mm512_mul_ps(_mm512_add_ps(a[j][0], a[j][1]), _mm512_set1_ps(scale)));
}

// Pass 1 over K in pairs: each block's positions 16 at a time, each KV head's query heads up to
// 8 at a time, one pair product per pair of dims.
void scores_pairs(const at::BFloat16* kc, const at::BFloat16* vc, const int64_t* blocks,
                  const int64_t* offs, int64_t len, const at::BFloat16* q, float scale,
                  float* scores, const Shape& s, int64_t ahead, int64_t hint) {
  const int64_t group = s.heads / s.kv_heads, row = s.kv_heads * s.dim, pairs = s.dim / 2;
  const int32_t* qp = reinterpret_cast<const int32_t*>(q);
  for (int64_t t = 0; t < len; t += PAIR_POS) {
    const int64_t n = std::min(PAIR_POS, len - t);
    for (int64_t pos = t; pos < t + n; ++pos)  // the blocks' bytes in order, as rows would be
      ask_ahead_of_k(kc, vc, offs, pos, len, ahead, row, hint);
    const at::BFloat16* base =
        kc + blocks[t / s.block_size] * s.block_size * row + (t % s.block_size) * 2;
    for (int64_t h = 0; h < s.kv_heads; ++h) {
      const at::BFloat16* k = base + h * s.dim * s.block_size;
      for (int64_t j = 0; j < group; j += MAX_GROUP) {
        const int64_t r = h * group + j;
        const int32_t* qr = qp + r * pairs;
        float* out = scores + r * len + t;
        switch (std::min(MAX_GROUP, group - j)) {
#define G(N) case N: pair_scores<N>(k, qr, pairs, pairs, s.block_size, scale, out, len, n); break;
          G(1) G(2) G(3) G(4) G(5) G(6) G(7) G(8)
#undef G
        }
      }
    }
  }
}
#endif

// One head's `len` scores at p (times `scale`) into exp(score - top) in place, with `top` the
// largest scaled score and `total` the terms' sum. In vectors, four maxima and two totals at a
// time: the compiler's loops (one chain of max, half-width libmvec exp) took a third of a
// sequence's time in cache.
void softmax_terms(float* p, int64_t len, float scale, float& top, float& total) {
  const Vec low(-std::numeric_limits<float>::infinity());
  Vec m[4] = {low, low, low, low};
  int64_t i = 0;
  for (; i + 4 * L <= len; i += 4 * L)
    for (int64_t u = 0; u < 4; ++u) m[u] = at::vec::maximum(m[u], Vec::loadu(p + i + u * L));
  for (; i + L <= len; i += L) m[0] = at::vec::maximum(m[0], Vec::loadu(p + i));
  const Vec most = at::vec::maximum(at::vec::maximum(m[0], m[1]), at::vec::maximum(m[2], m[3]));
  float raw = largest(most);
  for (; i < len; ++i) raw = std::max(raw, p[i]);
  top = raw * scale;
  const Vec shift(raw), k(scale);
  Vec sums[2] = {Vec(0.f), Vec(0.f)};
  i = 0;
  for (int64_t u = 0; i + L <= len; i += L, u ^= 1) {
    const Vec e = ((Vec::loadu(p + i) - shift) * k).exp_u20();
    e.store(p + i);
    sums[u] = sums[u] + e;
  }
  total = sum(sums[0] + sums[1]);
  for (; i < len; ++i) {
    p[i] = std::exp((p[i] - raw) * scale);
    total += p[i];
  }
}

// One sequence: q [heads, dim] -> out [heads, dim]. The next sequence's table and length (or
// null and 0) say whose rows to ask for once this one's have all been. With `unscaled` (for a
// part of a sequence, its table from the part's first block), the sums are not divided by the
// softmax's total: per head, the `dim` weighted sums, the largest score and the total go to
// unscaled[heads, dim + 2] instead of `out`, for merge_parts.
template <typename T, int64_t chunks, bool exact, int64_t v_rows>
void attend(const T* kc, const T* vc, const int64_t* blocks, int64_t len, const T* q,
            float scale, T* out, const Shape& s, Scratch& w, int64_t ahead, int64_t hint,
            int64_t mode, const int64_t* next_blocks, int64_t next_len, float* unscaled) {
  const int64_t group = s.heads / s.kv_heads, row = s.kv_heads * s.dim;
  const int64_t last = s.dim - (chunks - 1) * L;
  auto width = [&](int64_t c) { return exact || c < chunks - 1 ? L : last; };
  int64_t* offs = w.offs.data();
  float *scores = w.scores.data(), *part = w.part.data(), *acc = w.acc.data();
  for (int64_t pos = 0, b = 0; pos < len; ++b)
    for (int64_t o = 0; o < s.block_size && pos < len; ++o, ++pos)
      offs[pos] = (blocks[b] * s.block_size + o) * row;
  // Pass 1: each head's score per position, on AMX tiles (mode 2), or as one lane sum (mode 0),
  // or kept as part[r, i], head r's products with position t + i, and summed a tile at a time.
  const bool amx = mode == 2 || mode == 4;  // only for bf16 K in pairs the tiles fit: run()
#if defined(PREFIXSERVE_AMX)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (amx) scores_amx(kc, vc, blocks, offs, len, q, scale, scores, s, ahead, hint);
  }
#endif
  const bool k_pairs = mode == 3;  // run() passes 3 only for bf16 caches laid out in pairs
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (k_pairs) scores_pairs(kc, vc, blocks, offs, len, q, scale, scores, s, ahead, hint);
  }
#endif
  const bool tiles = mode == 1;
  constexpr bool pairs = BF16_PAIRS && std::is_same_v<T, at::BFloat16> && exact && chunks % 2 == 0;
  Vec qv[MAX_HEADS * chunks];  // q scaled, for lane sums and vector tiles alone
  for (int64_t r = 0; !amx && !k_pairs && r < s.heads; ++r)
    for (int64_t c = 0; c < chunks; ++c)
      qv[r * chunks + c] = load(q + r * s.dim + c * L, width(c)) * Vec(scale);
  for (int64_t t = 0; !amx && !k_pairs && t < len; t += L) {
    const int64_t n = std::min(L, len - t);
    for (int64_t pos = t; pos < t + n; ++pos) {
      ask_ahead_of_k(kc, vc, offs, pos, len, ahead, row, hint);
      const T* k = kc + offs[pos];
      float* p = part + (pos - t) * L;
      for (int64_t h = 0; h < s.kv_heads; ++h) {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
        // 32 bf16 of K and of q per instruction, in tiles; the scale comes with the sums.
        if constexpr (pairs) {
          if (tiles) {
            __m512bh kb[chunks / 2];
            for (int64_t c = 0; c < chunks / 2; ++c)
              kb[c] = (__m512bh)_mm512_loadu_si512(k + h * s.dim + c * 2 * L);
            for (int64_t r = h * group; r < (h + 1) * group; ++r) {
              __m512 a = _mm512_setzero_ps();
              for (int64_t c = 0; c < chunks / 2; ++c)
                a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(q + r * s.dim + c * 2 * L),
                                     kb[c]);
              _mm512_storeu_ps(p + r * L * L, a);
            }
            continue;
          }
        }
#endif
        Vec x[chunks];
        for (int64_t c = 0; c < chunks; ++c) x[c] = load(k + h * s.dim + c * L, width(c));
        for (int64_t r = h * group; r < (h + 1) * group; ++r) {
          Vec a = qv[r * chunks] * x[0];
          for (int64_t c = 1; c < chunks; ++c) a = at::vec::fmadd(qv[r * chunks + c], x[c], a);
          if (tiles) {
            a.store(p + r * L * L);
          } else {
            scores[r * len + pos] = sum(a);
          }
        }
      }
    }
    for (int64_t r = 0; tiles && r < s.heads; ++r) {
      Vec tile[L];
      for (int64_t i = 0; i < L; ++i)
        tile[i] = i < n ? Vec::loadu(part + (r * L + i) * L) : Vec(0.f);
      const Vec total = pairs ? sums(tile) * Vec(scale) : sums(tile);
      total.store(scores + r * len + t, n);
    }
  }
  for (int64_t r = 0; r < s.heads; ++r) {
    float* p = scores + r * len;
    float top, total;
    softmax_terms(p, len, amx ? scale : 1.f, top, total);
    if (unscaled != nullptr) {
      unscaled[r * (s.dim + 2) + s.dim] = top;
      unscaled[r * (s.dim + 2) + s.dim + 1] = total;
      continue;
    }
    const float inv = 1.f / total;
    for (int64_t i = 0; i < len; ++i) p[i] *= inv;
  }
  // Pass 2: v_rows rows at a time into each head's accumulators; past the end, the last row
  // again, weighed 0.
  // (Mode 4: on AMX tiles, over V in pairs of positions.)
  std::fill(acc, acc + s.heads * chunks * L, 0.f);
#if defined(PREFIXSERVE_AMX)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (mode == 4)
      v_amx(vc, kc, blocks, offs, len, scores, acc, s, w.weights.data(), w.tail.data(), ahead,
            hint, next_blocks, next_len);
  }
#endif
  for (int64_t pos = 0; mode != 4 && pos < len; pos += v_rows) {
    const T* v[v_rows];
    for (int64_t u = 0; u < v_rows; ++u) {
      const int64_t at = pos + u;
      v[u] = vc + offs[std::min(at, len - 1)];
      ask_ahead_of_v(kc, vc, offs, at, len, ahead, row, hint, next_blocks, next_len, s);
    }
    for (int64_t h = 0; h < s.kv_heads; ++h) {
      Vec x[v_rows][chunks];
      for (int64_t u = 0; u < v_rows; ++u)
        for (int64_t c = 0; c < chunks; ++c) x[u][c] = load(v[u] + h * s.dim + c * L, width(c));
      for (int64_t r = h * group; r < (h + 1) * group; ++r) {
        Vec p[v_rows];
        for (int64_t u = 0; u < v_rows; ++u)
          p[u] = Vec(pos + u < len ? scores[r * len + pos + u] : 0.f);
        float* a = acc + r * chunks * L;
        for (int64_t c = 0; c < chunks; ++c) {
          Vec total = Vec::loadu(a + c * L);
          for (int64_t u = 0; u < v_rows; ++u) total = at::vec::fmadd(p[u], x[u][c], total);
          total.store(a + c * L);
        }
      }
    }
  }
  for (int64_t r = 0; r < s.heads; ++r)
    for (int64_t d = 0; d < s.dim; ++d) {
      if (unscaled != nullptr) {
        unscaled[r * (s.dim + 2) + d] = acc[r * chunks * L + d];
      } else {
        out[r * s.dim + d] = T(acc[r * chunks * L + d]);
      }
    }
}

// A sequence's positions [from, to). A thread's share of a step is a run of these.
struct Part {
  int64_t seq, from, to;
};
constexpr int64_t PART_MIN = 256;  // positions: a part shorter reads too little to pay its merge

// Every sequence's positions end to end, cut into a share a thread of about equal length: a
// sequence is cut at a block's end where a share ends inside it and both sides keep PART_MIN
// positions, else the share takes it whole and the next one is shorter. (Uncut, one long
// sequence, a lone stream or a long one among short ones, is read by one thread while the rest
// wait.) Returns the parts in order, a sequence's adjacent, and where each share starts in them.
std::pair<std::vector<Part>, std::vector<int64_t>> shares(const int64_t* lens, int64_t n,
                                                          const Shape& s, int64_t threads) {
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) total += lens[i];
  const int64_t share = (total + threads - 1) / threads;
  const int64_t least = (PART_MIN + s.block_size - 1) / s.block_size * s.block_size;
  std::vector<Part> parts;
  std::vector<int64_t> starts{0};
  int64_t room = share;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t from = 0; from < lens[i];) {
      const bool last = int64_t(starts.size()) == threads;
      int64_t to = lens[i];
      if (!last && to - from > room) {
        const int64_t rounded = (room + s.block_size / 2) / s.block_size * s.block_size;
        const int64_t cut = from + std::max(rounded, least);
        if (to - cut >= PART_MIN) to = cut;
      }
      parts.push_back({i, from, to});
      room -= to - from;
      if (!last && (to < lens[i] || room <= 0)) {
        starts.push_back(int64_t(parts.size()));
        room += share;
      }
      from = to;
    }
  }
  if (starts.back() != int64_t(parts.size())) starts.push_back(int64_t(parts.size()));
  return {parts, starts};
}

// One sequence's output from its parts' (attend's `unscaled`): each part's sums and total
// scaled by e^(its largest score - the largest of all), then the sums divided by the total.
template <typename T>
void merge_parts(const float* parts, int64_t count, const Shape& s, T* out) {
  const int64_t stride = s.heads * (s.dim + 2);
  for (int64_t r = 0; r < s.heads; ++r) {
    const float* head = parts + r * (s.dim + 2);
    float top = -INFINITY, total = 0.f;
    for (int64_t u = 0; u < count; ++u) top = std::max(top, head[u * stride + s.dim]);
    float weight[MAX_PARTS];
    for (int64_t u = 0; u < count; ++u) {
      weight[u] = std::exp(head[u * stride + s.dim] - top);
      total += weight[u] * head[u * stride + s.dim + 1];
    }
    for (int64_t d = 0; d < s.dim; ++d) {
      float sum = 0.f;
      for (int64_t u = 0; u < count; ++u) sum += weight[u] * head[u * stride + d];
      out[r * s.dim + d] = T(sum / total);
    }
  }
}

// The head's vector count and the V rows per pass as template arguments, so that the
// per-position loops unroll.
template <typename T, typename... Args>
void attend_any(int64_t dim, int64_t v_rows, Args&&... args) {
  const int64_t chunks = (dim + L - 1) / L;
  const bool exact = dim % L == 0;
  switch (chunks) {
#define ROWS(C, E) return v_rows == 4 ? attend<T, C, E, 4>(args...) : attend<T, C, E, 1>(args...);
#define CASE(C) case C: if (exact) { ROWS(C, true) } else { ROWS(C, false) }
    CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
    CASE(9) CASE(10) CASE(11) CASE(12) CASE(13) CASE(14) CASE(15) CASE(16)
#undef CASE
#undef ROWS
  }
}

// Rows of [heads, dim] with the heads of a row contiguous (a view of the fused q/k/v projection's
// output will do): the step between rows, or an error.
int64_t row_stride(const at::Tensor& x, int64_t heads, int64_t dim, const char* what) {
  TORCH_CHECK(x.dim() == 3 && x.size(1) == heads && x.size(2) == dim && x.stride(2) == 1 &&
                  (heads == 1 || x.stride(1) == dim),
              "paged_decode: ", what, " must be [n, ", heads, ", ", dim,
              "] with each row's heads contiguous");
  return x.stride(0);
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
         const at::Tensor& block_tables, const at::Tensor& context_lens, at::Tensor& out,
         double scale, const std::optional<at::Tensor>& k_new,
         const std::optional<at::Tensor>& v_new, int64_t ahead, int64_t hint, int64_t mode,
         int64_t v_rows) {
  const Shape s{q.size(1), k_cache.size(2), q.size(2), k_cache.size(1), block_tables.size(1)};
  const int64_t n = q.size(0), chunks = (s.dim + L - 1) / L, row = s.kv_heads * s.dim;
  const int64_t q_step = row_stride(q, s.heads, s.dim, "q");
  const T* qp = q.data_ptr<T>();
  T* kp = k_cache.data_ptr<T>();
  T* vp = v_cache.data_ptr<T>();
  const T* knp = k_new ? k_new->data_ptr<T>() : nullptr;
  const T* vnp = v_new ? v_new->data_ptr<T>() : nullptr;
  const int64_t k_step = k_new ? row_stride(*k_new, s.kv_heads, s.dim, "k_new") : 0;
  const int64_t v_step = v_new ? row_stride(*v_new, s.kv_heads, s.dim, "v_new") : 0;
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const int64_t num_blocks = k_cache.size(0);
  int64_t longest = 0;
  for (int64_t i = 0; i < n; ++i) {  // a bad table would read outside the cache: refuse it
    TORCH_CHECK(lens[i] >= 1 && lens[i] <= s.table_width * s.block_size,
                "paged_decode: context length ", lens[i], " outside the block table");
    for (int64_t b = 0; b < (lens[i] + s.block_size - 1) / s.block_size; ++b) {
      const int64_t id = tables[i * s.table_width + b];
      TORCH_CHECK(id >= 0 && id < num_blocks, "paged_decode: block id ", id, " outside the cache");
    }
    longest = std::max(longest, lens[i]);
  }
  // AMX tiles where they fit (a head in 32s, up to 16 query heads a KV head), pair products
  // elsewhere.
#if defined(PREFIXSERVE_AMX)
  if (mode == 2 && !amx_fits(s)) mode = 3;  // K is in pairs either way
  TORCH_CHECK(mode != 4 || (std::is_same_v<T, at::BFloat16> && amx_fits(s)),
              "paged_decode: V in pairs needs bf16, heads in 32s, up to 16 query heads a KV "
              "head and blocks in 16s");
#endif
  const bool k_paired = mode == 2 || mode == 3 || mode == 4, v_paired = mode == 4;
  TORCH_CHECK(!k_paired || (std::is_same_v<T, at::BFloat16> && pairs_fit(s)),
              "paged_decode: K in pairs needs bf16, a head size in 4s and blocks in 16s");
  // One task per thread's share (`shares`). Where no sequence is cut, a task stores each of its
  // sequences' new K/V row (the last position of its table, a block no other sequence holds)
  // before reading that sequence; else every new row is stored before any task runs.
  const auto [parts, starts] =
      shares(lens, n, s, std::min<int64_t>(at::get_num_threads(), MAX_PARTS));
  const bool whole = int64_t(parts.size()) == n;
  auto store = [&](int64_t i) {
    if (knp == nullptr) return;
    const int64_t slot = row_at(tables + i * s.table_width, lens[i] - 1, s, row);
    const int64_t o = (lens[i] - 1) % s.block_size, base = slot - o * row;
    if (k_paired) {
      for (int64_t h = 0; h < s.kv_heads; ++h)
        for (int64_t d = 0; d < s.dim; ++d)
          kp[base + k_pair_at(o, h, d, s)] = knp[i * k_step + h * s.dim + d];
    } else {
      std::copy(knp + i * k_step, knp + i * k_step + row, kp + slot);
    }
    if (v_paired) {
#if defined(PREFIXSERVE_AMX)
      for (int64_t h = 0; h < s.kv_heads; ++h)
        for (int64_t d = 0; d < s.dim; ++d)
          vp[base + v_pair_at(o, h, d, s)] = vnp[i * v_step + h * s.dim + d];
#endif
    } else {
      std::copy(vnp + i * v_step, vnp + i * v_step + row, vp + slot);
    }
  };
  for (int64_t i = 0; !whole && i < n; ++i) store(i);
  const int64_t part_size = s.heads * (s.dim + 2);
  std::vector<float> partial(whole ? 0 : parts.size() * part_size);
  auto table = [&](const Part& p) {
    return tables + p.seq * s.table_width + p.from / s.block_size;
  };
  at::parallel_for(0, int64_t(starts.size()) - 1, 1, [&](int64_t first, int64_t after) {
    const int64_t begin = starts[first], end = starts[after];
    Scratch w{std::vector<int64_t>(longest), std::vector<float>(s.heads * longest),
              std::vector<float>(s.heads * L * L), std::vector<float>(s.heads * chunks * L),
              std::vector<at::BFloat16>(v_paired ? s.kv_heads * V_ROWS * PAIR_POS : 0),
              std::vector<at::BFloat16>(v_paired ? PAIR_POS * s.dim : 0)};
#if defined(PREFIXSERVE_AMX)
    if (mode == 2 || mode == 4) configure_scores(s.heads / s.kv_heads);
#endif
    for (int64_t t = begin; t < end; ++t) {
      const Part& p = parts[t];
      if (whole) store(p.seq);
      const Part* next = t + 1 < end ? &parts[t + 1] : nullptr;
      attend_any<T>(s.dim, v_rows, kp, vp, table(p), p.to - p.from, qp + p.seq * q_step,
                    float(scale), op + p.seq * s.heads * s.dim, s, w, ahead, hint, mode,
                    next ? table(*next) : nullptr, next ? next->to - next->from : int64_t(0),
                    whole ? nullptr : partial.data() + t * part_size);
    }
#if defined(PREFIXSERVE_AMX)
    if (mode == 2 || mode == 4) _tile_release();
#endif
  });
  for (size_t t = 0, u = 0; !whole && t < parts.size(); t = u) {
    while (u < parts.size() && parts[u].seq == parts[t].seq) ++u;
    merge_parts(partial.data() + t * part_size, int64_t(u - t), s,
                op + parts[t].seq * s.heads * s.dim);
  }
}

}  // namespace

bool amx_tiles();  // tile_linear.cpp

// q [n, heads, dim] (each row's heads contiguous); caches [num_blocks, block_size, kv_heads, dim];
// block_tables [n, width] int64; context_lens [n] int64, each >= 1. With k_new and v_new
// [n, kv_heads, dim] (rows as q's), each sequence's new token's K/V are first written at its
// last position (context_lens - 1). `ahead`: rows asked for ahead of their use (0: none), with
// `hint` (3: prefetcht0, 2: prefetcht1, 0: prefetchnta); `scores`: summed per position (0), a
// tile of positions at a time (1), from K laid out in pairs on AMX tiles (2; as 3, pair
// products where the tiles do not fit the shape) or with pair products (3; bf16, head size in
// 4s, blocks in 16s: k_cache holds it so, and k_new is stored so), or both passes on AMX tiles
// with K and V in pairs (4; v_cache and v_new likewise); `v_rows`: V rows added per pass over
// the accumulators (1 or 4; 4's weighted sum is on tiles and takes none).
// Returns [n, heads, dim] in q's dtype, contiguous.
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& context_lens,
                        double scale, const std::optional<at::Tensor>& k_new,
                        const std::optional<at::Tensor>& v_new, int64_t ahead, int64_t hint,
                        int64_t scores, int64_t v_rows) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_decode: the caches must be contiguous");
  TORCH_CHECK(block_tables.is_contiguous() && context_lens.is_contiguous() &&
                  block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "paged_decode: block tables and context lengths must be contiguous int64");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "paged_decode: q and the caches must share a dtype");
  TORCH_CHECK(q.dim() == 3 && q.size(2) <= MAX_CHUNKS * L && q.size(1) <= MAX_HEADS &&
                  q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0,
              "paged_decode: unsupported head layout");
  TORCH_CHECK(k_new.has_value() == v_new.has_value(), "paged_decode: k_new and v_new go together");
  TORCH_CHECK(ahead >= 0, "paged_decode: ahead must be >= 0, not ", ahead);
  TORCH_CHECK(hint == 0 || hint == 2 || hint == 3, "paged_decode: hint must be 0, 2 or 3, not ",
              hint);
  TORCH_CHECK(v_rows == 1 || v_rows == 4, "paged_decode: v_rows must be 1 or 4, not ", v_rows);
  TORCH_CHECK(scores >= 0 && scores <= 4, "paged_decode: scores must be 0 to 4, not ", scores);
  TORCH_CHECK((scores != 2 && scores != 4) || amx_tiles(),
              "paged_decode: this build or CPU has no AMX-BF16 tiles");
  TORCH_CHECK(scores != 3 || BF16_PAIRS, "paged_decode: K in pairs needs AVX512-BF16");
  if (k_new) {
    TORCH_CHECK(k_new->scalar_type() == q.scalar_type() && v_new->scalar_type() == q.scalar_type() &&
                    k_new->size(0) == q.size(0) && v_new->size(0) == q.size(0),
                "paged_decode: k_new and v_new must be q's dtype, a row per sequence");
  }
  auto out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  if (q.size(0) == 0) return out;
  switch (q.scalar_type()) {
    case at::kFloat:
      run<float>(q, k_cache, v_cache, block_tables, context_lens, out, scale, k_new, v_new, ahead,
                 hint, scores, v_rows);
      break;
    case at::kBFloat16:
      run<at::BFloat16>(q, k_cache, v_cache, block_tables, context_lens, out, scale, k_new, v_new,
                        ahead, hint, scores, v_rows);
      break;
    default: TORCH_CHECK(false, "paged_decode: unsupported dtype ", q.scalar_type());
  }
  return out;
}

int64_t paged_decode_max_head_dim() { return MAX_CHUNKS * L; }
int64_t paged_decode_max_heads() { return MAX_HEADS; }
int64_t vector_width() { return L; }
bool paged_decode_k_pairs() { return BF16_PAIRS; }
