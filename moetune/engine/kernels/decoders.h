// Weight decoders shared by every kernel variant: each turns a format's stored codes into fp32 values of the
// dequantized matrix W [O, K], 16 columns at a time (AVX512 variants) or 8 (the AVX2 one), in registers.
//
// Contract (a later format adds one struct with these two members, and an entry point in entry.h):
//   __m512 operator()(int64_t o, int64_t k0, int valid) const
//       the 16 fp32 values W[o, k0 .. k0 + 16) (k0 % 16 == 0), lanes at and past `valid` zero (valid may be
//       <= 0 or >= 16); each value is exactly the one the format's torch path multiplies with (bf16: the stored
//       value; int8: the code, its row scale applied by the caller; int4: (u - z) * s in fp32, rounded to bf16 by
//       the caller; fp8_block: code * scale_inv in fp32; mxfp4: FP4[code] * 2^(s - 127), exact).
//   __m256 eight(int64_t o, int64_t k0, int valid) const
//       the same for W[o, k0 .. k0 + 8) (k0 % 8 == 0) on AVX2 + FMA + F16C, 8 fp32 lanes: the same values (one
//       scalar helper per format gives both widths their scale), lanes at and past `valid` zero.
//   const void* code(int64_t o, int64_t k) const
//       the address of W[o, k]'s code (k < K), for prefetch below; no effect on results.
// and, optionally, for the AVX2 variant's decoded blocks (avx2_gemm.cpp's decode_row takes it when present):
//   void span8(int64_t o, int64_t k0, int64_t cols, float* dst) const
//       W[o, k0 .. k0 + cols) into dst (k0 % 8 == 0, cols % 8 == 0, k0 + cols <= K): the values `eight` gives, each
//       scale and zero point read once per run of columns it covers instead of once per 8 (int4, mxfp4,
//       fp8_block), whole loads without a tail's case (all)
// and, where a format has few enough values per scale for a table (bf16_chunk below takes it when present):
//   __m512i bf16x32(int64_t o, int64_t k0) const
//       W[o, k0 .. k0 + 32) (k0 % 32 == 0, k0 + 32 <= K) rounded to bf16, bit for bit the values operator() gives
//       rounded to nearest even, each code looked up instead of decoded: int4's and mxfp4's 16 values of the
//       chunk's group computed into a register (vpermw); fp8_block's 128 magnitudes of each block computed once
//       per call by fp8_tables where the variant builds them (MOETUNE_TABLES, entry.h; two vpermt2w).
// and, optionally, for the AVX512 forward (avx512_gemm.cpp takes them when bf16_row is present; int4):
//   bool whole_rows() const; void bf16_row(int64_t o, uint16_t* dst) const
//       W[o, 0 .. K) into dst (64-byte aligned), bf16x32's values, where whole_rows() (the decoded forward)
//   bool dot_row_tables() const; void row_tables(int64_t o, RowTables& t) const;
//   __m512i row_chunk(int64_t o, int64_t k0, const RowTables& t) const
//       the same 32 values at k0 from row o's tables made first (the forward's dot products, where dot_row_tables())
// and, where each value is a scale times a value exact in bf16 (the group-scaled form, for few_rows.h's backward with
// few rows of g: RawPairs32 there multiplies g by the scales instead of each weight):
//   W[o, k] = S(o, k) * V[o, k], S constant over aligned runs of 2^raw_shift() >= 32 columns of a row
//   bool raw_ok(int64_t rows) const      whether to take the form with this many rows of g (int4: groups of >= 32)
//   static constexpr bool kRawUnstaged   whether few_rows.h's band walk decodes the raw rows between its dot products
//                                        with 6-8 rows of g (raw_staged; measured per format)
//   int raw_shift() const                log2 of the columns one scale covers
//   __m512 scales16(o, k0, __mmask16 m)  S(o + i, k0) for the lanes i in m, 0 in the others (fp32)
//   raw_rows(o0, k0, valid, f)           calls f(row, addr): row(i) gives V[o0 + i, k0 .. k0 + 32) as 32 bf16 (zero
//                                        past K: valid = K - k0), addr(i) the address of its codes (for prefetch)
// Compiled for AVX512F/BW/VL (+BF16) through target attributes, so a variant compiled with other flags (the
// AMX one adds amx-tile/amx-bf16) inlines them into its own target-attributed loops; ``eight`` for AVX2 + FMA +
// F16C, the flags avx2_gemm.cpp is compiled with.
#pragma once

#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#define MOETUNE_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx512vnni")))
#define MOETUNE_AVX2 __attribute__((target("avx2,fma,f16c")))
// for the small helpers the loops call per chunk: GCC left some out of line (a call per 32 weights: 2x slower)
#define MOETUNE_ALWAYS_INLINE inline __attribute__((always_inline))

namespace moetune {

// the 8 bytes at p, or its first `valid` (< 8) bytes and zeros: no read past a row's end (AVX2 has no masked
// byte loads)
MOETUNE_AVX2 inline __m128i load8(const void* p, int valid) {
  if (valid >= 8) return _mm_loadl_epi64(static_cast<const __m128i*>(p));
  uint64_t v = 0;
  std::memcpy(&v, p, valid > 0 ? valid : 0);
  return _mm_cvtsi64_si128(static_cast<long long>(v));
}

// the first `valid` of 16 lanes (none for valid <= 0, all for valid >= 16)
MOETUNE_AVX512 inline __mmask16 first(int valid) {
  return valid >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (valid > 0 ? valid : 0)) - 1u);
}

// the first `valid` of 32 16-bit lanes (none for valid <= 0, all for valid >= 32)
MOETUNE_AVX512 inline __mmask32 first32(int64_t valid) {
  return valid >= 32 ? ~(__mmask32)0 : (__mmask32)((1u << (valid > 0 ? valid : 0)) - 1u);
}

// base[idx[i]] for the lanes in m (others 0), bytes (gather_u8) or 16-bit words (gather_u16, base 2-byte aligned),
// each read through the aligned 32-bit word that holds it: a gather never reads past the page of a value it returns
MOETUNE_AVX512 inline __m512i gather_aligned(const void* base, __m512i offset, __mmask16 m, int bits) {
  const int mis = static_cast<int>(reinterpret_cast<uintptr_t>(base) & 3);
  const void* aligned = static_cast<const char*>(base) - mis;
  const __m512i at = _mm512_add_epi32(offset, _mm512_set1_epi32(mis));  // byte offsets from `aligned`
  const __m512i words = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m,
                                                    _mm512_andnot_si512(_mm512_set1_epi32(3), at), aligned, 1);
  const __m512i shift = _mm512_slli_epi32(_mm512_and_si512(at, _mm512_set1_epi32(3)), 3);
  return _mm512_and_si512(_mm512_srlv_epi32(words, shift), _mm512_set1_epi32((1 << bits) - 1));
}
MOETUNE_AVX512 inline __m512i gather_u8(const uint8_t* base, __m512i idx, __mmask16 m) {
  return gather_aligned(base, idx, m, 8);
}
MOETUNE_AVX512 inline __m512i gather_u16(const void* base, __m512i idx, __mmask16 m) {
  return gather_aligned(base, _mm512_add_epi32(idx, idx), m, 16);
}
// o, o + 1, ..., o + 15 as 32-bit lanes
MOETUNE_AVX512 inline __m512i rows16(int64_t o) {
  return _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(o)),
                          _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
}

// scalar, so no target attribute: an AVX512-targeted helper cannot be inlined into the AVX2 variant's loops (GCC
// called it through the PLT per 8 weights there)
inline float bf16_to_float(const at::BFloat16 v) {
  uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// bf16: W [O, K] stored in bf16 (dense experts), each value widened exactly to fp32. The AVX512-BF16 variant
// multiplies these weights without this decoder (few_rows.h: its loops load them as they are); the other variants'
// generic loops take it.
struct Bf16Rows {
  const at::BFloat16* w;  // [O, K], rows ld apart (ld >= K: DenseExperts pads rows whose bytes would alias in L1)
  int64_t ld;
  MOETUNE_AVX512 inline __m512 operator()(int64_t o, int64_t k0, int valid) const {
    const __m256i b = _mm256_maskz_loadu_epi16(first(valid), w + o * ld + k0);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
  }
  // the 8 bf16 values in b widened to fp32
  MOETUNE_AVX2 static MOETUNE_ALWAYS_INLINE __m256 decode8(__m128i b) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
  }
  // (the whole 8 return before the tail's stack buffer exists, as load8: with one buffer for both, GCC 12 stored
  // its zeros to the stack in every step of the decoding loops)
  MOETUNE_AVX2 inline __m256 eight(int64_t o, int64_t k0, int valid) const {
    if (valid >= 8) return decode8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + o * ld + k0)));
    __m128i b = _mm_setzero_si128();
    std::memcpy(&b, w + o * ld + k0, 2 * (valid > 0 ? valid : 0));
    return decode8(b);
  }
  MOETUNE_AVX2 inline void span8(int64_t o, int64_t k0, int64_t cols, float* dst) const {
    const at::BFloat16* p = w + o * ld + k0;
    for (int64_t c = 0; c < cols; c += 8)
      _mm256_storeu_ps(dst + c, decode8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + c))));
  }
  inline const void* code(int64_t o, int64_t k) const { return w + o * ld + k; }
};

// int8: codes [O, K] int8; W = diag(row scale) @ codes, the scale applied by the caller (exact codes here). (The
// AVX512-BF16 variant multiplies the codes as int16 instead: int16_rows.h.)
struct Int8Rows {
  const int8_t* codes;  // [O, K]
  int64_t K;
  MOETUNE_AVX512 inline __m512 operator()(int64_t o, int64_t k0, int valid) const {
    // a mask only on a row's partial tail (as Fp8BlockRows: masked loads on every call cost more)
    const int8_t* p = codes + o * K + k0;
    const __m128i b =
        valid >= 16 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)) : _mm_maskz_loadu_epi8(first(valid), p);
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
  }
  // the 8 codes in b's low bytes as fp32
  MOETUNE_AVX2 static MOETUNE_ALWAYS_INLINE __m256 decode8(__m128i b) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  }
  MOETUNE_AVX2 inline __m256 eight(int64_t o, int64_t k0, int valid) const {
    return decode8(load8(codes + o * K + k0, valid));
  }
  MOETUNE_AVX2 inline void span8(int64_t o, int64_t k0, int64_t cols, float* dst) const {
    const int8_t* p = codes + o * K + k0;
    for (int64_t c = 0; c < cols; c += 8)
      _mm256_storeu_ps(dst + c, decode8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + c))));
  }
  inline const void* code(int64_t o, int64_t k) const { return codes + o * K + k; }
};

// the 16 bf16 values of the table f(0 .. 15) (fp32 values, rounded to nearest even) in a vpermw table's first 16 words
MOETUNE_AVX512 MOETUNE_ALWAYS_INLINE __m512i table16(__m512 values) {
  return _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(values));
}

// 32 codes 0 .. 15 (one per byte) -> their 32 bf16 values from table16's table
MOETUNE_AVX512 MOETUNE_ALWAYS_INLINE __m512i lookup32(__m256i codes, __m512i table) {
  return _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(codes), table);
}

// a decoder's last table (bf16x32 with a cache) and the group it was made for (-1: none)
struct TableCache {
  __m512i table;
  int64_t key = -1;
};

// a row's vpermw tables of 16 bf16 values, one per group, made before any lookup (bf16_row; the tables made as a
// row's chunks reach their groups held each lookup on the table's making: int4's forward at 25-64 rows 1.02-1.24x)
struct RowTables {
  static constexpr int64_t kMax = 256;  // groups per row (K = 8192 with groups of 32)
  alignas(64) __m256i t[kMax];
  MOETUNE_AVX512 MOETUNE_ALWAYS_INLINE void set(int64_t g, __m512i table) { t[g] = _mm512_castsi512_si256(table); }
  MOETUNE_AVX512 MOETUNE_ALWAYS_INLINE __m512i get(int64_t g) const { return _mm512_castsi256_si512(t[g]); }
};

// int4: W[o, k] = (u - z) * s with u the 4-bit code, z the group's zero point (8 when symmetric), s its bf16 scale.
struct Int4Rows {
  const uint8_t* packed;  // [O, K/2]: byte j holds u[j] (low nibble) and u[j + K/2] (high nibble)
  const at::BFloat16* scale;  // [O, K/g]
  const uint8_t* zero;  // [O, K/g] or null (symmetric: z = 8)
  int64_t half, groups;  // K/2, K/g
  int shift;  // log2(g): g is a power of two (32, 64, 128), so no division per call
  MOETUNE_AVX512 inline __m512 operator()(int64_t o, int64_t k0, int valid) const {
    // K is a multiple of 32 (K/2 of 16) and k0 of 16, so valid is >= 16 or <= 0: whole loads, no masks; past K
    // there is no scale or zero point to read
    if (valid <= 0) return _mm512_setzero_ps();
    const bool high = k0 >= half;  // no chunk straddles K/2
    const uint8_t* p = packed + o * half + (high ? k0 - half : k0);
    __m512i u = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    u = high ? _mm512_srli_epi32(u, 4) : _mm512_and_si512(u, _mm512_set1_epi32(0x0F));
    const int64_t gi = o * groups + (k0 >> shift);
    __m512 w = _mm512_cvtepi32_ps(_mm512_sub_epi32(u, _mm512_set1_epi32(zero_point(gi))));
    return _mm512_mul_ps(w, _mm512_set1_ps(bf16_to_float(scale[gi])));
  }
  // (u - z) * s for the 8 codes at p (the high nibbles past K/2, else the low), z and s broadcast
  MOETUNE_AVX2 static MOETUNE_ALWAYS_INLINE __m256 decode8(const uint8_t* p, bool high, __m256i z, __m256 s) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256i u = high ? _mm256_srli_epi32(b, 4) : _mm256_and_si256(b, _mm256_set1_epi32(0x0F));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(u, z)), s);
  }
  MOETUNE_AVX2 inline __m256 eight(int64_t o, int64_t k0, int valid) const {
    if (valid <= 0) return _mm256_setzero_ps();  // K is a multiple of 32: valid >= 8 or <= 0
    const bool high = k0 >= half;
    const int64_t gi = o * groups + (k0 >> shift);
    return decode8(packed + o * half + (high ? k0 - half : k0), high, _mm256_set1_epi32(zero_point(gi)),
                   _mm256_set1_ps(bf16_to_float(scale[gi])));
  }
  MOETUNE_AVX2 inline void span8(int64_t o, int64_t k0, int64_t cols, float* dst) const {
    const int64_t g = int64_t{1} << shift;
    for (int64_t c = 0; c < cols;) {  // one run per group and side of K/2
      const int64_t k = k0 + c;
      const bool high = k >= half;
      int64_t end = std::min(cols, c + g - (k & (g - 1)));
      if (!high) end = std::min(end, half - k0);
      const int64_t gi = o * groups + (k >> shift);
      const __m256i z = _mm256_set1_epi32(zero_point(gi));
      const __m256 sc = _mm256_set1_ps(bf16_to_float(scale[gi]));
      const uint8_t* p = packed + o * half + (high ? k - half : k);
      for (; c < end; c += 8, p += 8) _mm256_storeu_ps(dst + c, decode8(p, high, z, sc));
    }
  }
  // groups of >= 32 columns (shift >= 5) and a chunk on one side of K/2: one table (else two 16-column decodes),
  // taken from `cache` where it holds this group's (a caller walking a row along k keeps one per row)
  MOETUNE_AVX512 MOETUNE_ALWAYS_INLINE __m512i bf16x32(int64_t o, int64_t k0, TableCache& cache) const {
    const bool high = k0 >= half;
    if (shift < 5 || (!high && k0 + 32 > half))
      return (__m512i)_mm512_cvtne2ps_pbh((*this)(o, k0 + 16, 16), (*this)(o, k0, 16));
    const int64_t gi = o * groups + (k0 >> shift);
    if (gi != cache.key) {
      cache.table = table(gi);
      cache.key = gi;
    }
    return lookup32(codes32(o, k0), cache.table);
  }
  // the 32 codes u of W[o, k0 .. k0 + 32), one per byte, for a chunk on one side of K/2
  MOETUNE_AVX512 MOETUNE_ALWAYS_INLINE __m256i codes32(int64_t o, int64_t k0) const {
    const bool high = k0 >= half;
    __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed + o * half + (high ? k0 - half : k0)));
    if (high) b = _mm256_srli_epi16(b, 4);
    return _mm256_and_si256(b, _mm256_set1_epi8(0x0F));
  }
  MOETUNE_AVX512 MOETUNE_ALWAYS_INLINE __m512i bf16x32(int64_t o, int64_t k0) const {
    TableCache none;
    return bf16x32(o, k0, none);
  }
  // whether a table lasts more than one 32-column chunk (groups of 64 or more)
  inline bool table_lasts() const { return shift > 5; }
  // group gi's 16 values (u - z) * s rounded to bf16, u = 0 .. 15 (a vpermw table)
  MOETUNE_AVX512 MOETUNE_ALWAYS_INLINE __m512i table(int64_t gi) const {
    const __m512i u = _mm512_sub_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                       _mm512_set1_epi32(zero_point(gi)));
    return table16(_mm512_mul_ps(_mm512_cvtepi32_ps(u), _mm512_set1_ps(bf16_to_float(scale[gi]))));
  }
  // whether a row's chunks each lie in one group and on one side of K/2, and its tables fit RowTables
  inline bool whole_rows() const { return shift >= 5 && half % 32 == 0 && groups <= RowTables::kMax; }
  // whether the AVX512 forward's dot products (1-8 rows) take row_chunk: symmetric codes 1.09-1.24x against the
  // tables made as a row's walk reaches its groups, with zero points 0.93-1.03x (docs/performance.md, "int4's rows
  // decoded with their tables made first")
  inline bool dot_row_tables() const { return whole_rows() && zero == nullptr; }
  // row o's tables, where whole_rows() (for row_chunk and bf16_row)
  MOETUNE_AVX512 MOETUNE_ALWAYS_INLINE void row_tables(int64_t o, RowTables& t) const {
    for (int64_t g = 0; g < groups; ++g) t.set(g, table(o * groups + g));
  }
  // W[o, k0 .. k0 + 32) in bf16 by row o's tables (row_tables), bf16x32's bits; where whole_rows() a chunk lies on
  // one side of K/2 and is whole
  MOETUNE_AVX512 MOETUNE_ALWAYS_INLINE __m512i row_chunk(int64_t o, int64_t k0, const RowTables& t) const {
    return lookup32(codes32(o, k0), t.get(k0 >> shift));
  }
  // W[o, 0 .. K) rounded to bf16 into dst (64-byte aligned), bit for bit bf16x32's values, where whole_rows(): the
  // row's tables made first (RowTables: no chunk's lookup waits on its table's making), then each 32 bytes of codes
  // read once for both halves of the row (low nibbles: columns j .., high: K/2 + j ..)
  MOETUNE_AVX512 void bf16_row(int64_t o, uint16_t* dst) const {
    RowTables t;
    row_tables(o, t);
    const uint8_t* p = packed + o * half;
    const __m256i nib = _mm256_set1_epi8(0x0F);
    for (int64_t j = 0; j < half; j += 32) {
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + j));
      _mm512_store_si512(dst + j, lookup32(_mm256_and_si256(b, nib), t.get(j >> shift)));
      _mm512_store_si512(dst + half + j,
                         lookup32(_mm256_and_si256(_mm256_srli_epi16(b, 4), nib), t.get((half + j) >> shift)));
    }
  }
  // group-scaled form (below): S = the group's scale, V = u - z; groups of >= 32 columns only
  inline bool raw_ok(int64_t /*rows*/) const { return shift >= 5; }
  // (unstaged at 6-8 rows: 0.33-0.5x, its decoding per call (the zero points' table, the K/2 cases) made per pair;
  // again on 2026-12-06: 1.04-1.08x at 8 rows, 0.95-1.03x at 6, 0.28x with groups of 128 and 0.88-0.90x with zero
  // points at 7: left staged)
  static constexpr bool kRawUnstaged = false;
  inline int raw_shift() const { return shift; }
  // rows of g up to which the backward takes this form (few_rows.h's use_raw_pairs): 8 per 32 columns a scale
  // covers, symmetric codes (V from one constant table) twice that, at most 32 (g32 / g64 / g128: 8 / 16 / 32 with
  // zero points, 16 / 32 / 32 without). Symmetric at twice the rows against the weights' bf16 values: g32 at 9-12
  // rows 1.06-1.24x, g64 at 20-32 rows 1.01-1.15x; with zero points g64 at 20-32 0.98x (docs/performance.md, "The
  // forward with many rows").
  inline int64_t raw_rows() const { return int64_t{8} << std::min(shift - (zero ? 5 : 4), 2); }
  MOETUNE_AVX512 inline __m512 scales16(int64_t o, int64_t k0, __mmask16 m) const {
    const __m512i idx = _mm512_add_epi32(_mm512_mullo_epi32(rows16(o), _mm512_set1_epi32(static_cast<int>(groups))),
                                         _mm512_set1_epi32(static_cast<int>(k0 >> shift)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(gather_u16(scale, idx, m), 16));
  }
  // the bf16 values u - z for u = 0 .. 15 in a vpermw table
  MOETUNE_AVX512 static MOETUNE_ALWAYS_INLINE __m512i zero_table(int z) {
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return table16(_mm512_cvtepi32_ps(_mm512_sub_epi32(iota, _mm512_set1_epi32(z))));
  }
  // V from a table: symmetric, the constant one of -8 .. 7; with zero points the row's z's (for z < 16 one of 16
  // made once per process, else made for the row)
  template <class F>
  MOETUNE_AVX512 MOETUNE_ALWAYS_INLINE void raw_rows(int64_t o0, int64_t k0, int64_t /*valid: K % 32 == 0*/,
                                                     F&& f) const {
    // a chunk lies on one side of K/2 or, where K/2 is an odd multiple of 16, straddles it (k0 + 16 = K/2: columns
    // k0 .. K/2 in the low nibbles of bytes k0 .., the next 16 in the high nibbles of bytes 0 ..)
    const bool high = k0 >= half, straddle = !high && k0 + 32 > half;
    const uint8_t* p = packed + o0 * half + (high ? k0 - half : k0);
    const int64_t step = half, zstep = groups;
    auto addr = [=](int64_t i) { return static_cast<const void*>(p + i * step); };
    auto codes = [=](int64_t i) MOETUNE_AVX512 {  // the 32 codes as 16-bit words
      const uint8_t* row = p + i * step;
      if (straddle) {
        const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row));
        const __m128i hi = _mm_srli_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row - k0)), 4);
        return _mm512_and_si512(_mm512_cvtepu8_epi16(_mm256_set_m128i(hi, lo)), _mm512_set1_epi16(0x0F));
      }
      const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row)));
      return high ? _mm512_srli_epi16(b, 4) : _mm512_and_si512(b, _mm512_set1_epi16(0x0F));
    };
    if (zero) {
      const uint8_t* z = zero + o0 * groups + (k0 >> shift);
      static const std::array<__m512i, 16> tables = []() MOETUNE_AVX512 {  // made once per process
        std::array<__m512i, 16> t;
        for (int zp = 0; zp < 16; ++zp) t[zp] = zero_table(zp);
        return t;
      }();
      f(
          [=](int64_t i) MOETUNE_AVX512 {
            const int zp = z[i * zstep];
            return _mm512_permutexvar_epi16(codes(i), zp < 16 ? tables[zp] : zero_table(zp));
          },
          addr);
      return;
    }
    const __m512i table = zero_table(8);
    f([=](int64_t i) MOETUNE_AVX512 { return _mm512_permutexvar_epi16(codes(i), table); }, addr);
  }
  inline int zero_point(int64_t gi) const { return zero ? zero[gi] : 8; }
  inline const void* code(int64_t o, int64_t k) const { return packed + o * half + (k >= half ? k - half : k); }
};

// fp8_block: W[o, k] = the e4m3fn code times scale_inv of its 128 x 128 block, rounded once to fp32, as the torch
// path computes it: the code's bits moved into fp16 (exactly value * 2^-8), widened, times scale_inv * 2^8.
struct Fp8BlockRows {
  const int8_t* codes;  // [O, K] e4m3fn bytes (no NaN codes: the format refuses them)
  const float* scale_inv;  // [grid rows, cols] fp32, cols = ceil(K / 128)
  int64_t K, cols;
  // rows from `seg` on take grid rows from `seg_grid` (gate_up: up's grid follows gate's; one segment: 0, 0)
  int64_t seg, seg_grid;
  // [grid rows, cols, 128]: each block's 128 magnitudes in bf16 (fp8_tables below), or null: bf16x32 decodes
  const uint16_t* table = nullptr;
  MOETUNE_AVX512 inline __m512 operator()(int64_t o, int64_t k0, int valid) const {
    if (valid <= 0) return _mm512_setzero_ps();  // k0 may be past K: no scale to read
    // masks only on a row's last, partial 16: masked loads and multiplies on every call measured 1.3-1.6x slower
    // for mxfp4's decoder and up to 1.25x for this one (n = 8, [1536, 2048], AVX512-BF16 on Zen 4)
    const bool whole = valid >= 16;
    const int8_t* p = codes + o * K + k0;
    const __m128i b =
        whole ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)) : _mm_maskz_loadu_epi8(first(valid), p);
    __m256i h = _mm256_cvtepi8_epi16(b);  // sign-extends
    h = _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16(static_cast<int16_t>(0xBF80)));
    const __m512 w = _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(mult(o, k0)));
    return whole ? w : _mm512_maskz_mov_ps(first(valid), w);
  }
  // the 8 codes in b's low bytes times m (the block's mult, broadcast): each code's bits moved into fp16, widened
  MOETUNE_AVX2 static MOETUNE_ALWAYS_INLINE __m256 decode8(__m128i b, __m256 m) {
    return _mm256_mul_ps(_mm256_cvtph_ps(half8(b)), m);
  }
  // the 8 codes in b's low bytes as fp16, each exactly its value * 2^-8: the sign-extended code shifted left 7 puts
  // the sign in bit 15 and exponent and mantissa in bits 7-13; bit 14 (a copy of the sign) cleared
  MOETUNE_AVX2 static MOETUNE_ALWAYS_INLINE __m128i half8(__m128i b) {
    return _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(b), 7), _mm_set1_epi16(static_cast<int16_t>(0xBF80)));
  }
  // half8 of the 16 codes in b
  MOETUNE_AVX2 static MOETUNE_ALWAYS_INLINE __m256i half16(__m128i b) {
    return _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7),
                            _mm256_set1_epi16(static_cast<int16_t>(0xBF80)));
  }
  MOETUNE_AVX2 inline __m256 eight(int64_t o, int64_t k0, int valid) const {
    if (valid <= 0) return _mm256_setzero_ps();
    // bytes past valid load as 0, the code of +0: no mask on the result
    return decode8(load8(codes + o * K + k0, valid), _mm256_set1_ps(mult(o, k0)));
  }
  MOETUNE_AVX2 inline void span8(int64_t o, int64_t k0, int64_t cols, float* dst) const {
    const int8_t* p = codes + o * K + k0;
    for (int64_t c = 0; c < cols;) {  // one run per 128-column block
      const int64_t end = std::min(cols, c + 128 - ((k0 + c) & 127));
      const __m256 m = _mm256_set1_ps(mult(o, k0 + c));
      for (; c < end; c += 8)
        _mm256_storeu_ps(dst + c, decode8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + c)), m));
    }
  }
  // 32 codes from the block's table: the magnitude (code & 0x7F) looked up in two 64-entry halves (vpermt2w on
  // its low 6 bits, bit 6 choosing the half), bit 15 flipped by the code's sign bit (bf16(-v) = -bf16(v))
  MOETUNE_AVX512 MOETUNE_ALWAYS_INLINE __m512i bf16x32(int64_t o, int64_t k0) const {
    if (!table) return (__m512i)_mm512_cvtne2ps_pbh((*this)(o, k0 + 16, 16), (*this)(o, k0, 16));
    const uint16_t* t = table + block(o, k0) * 128;
    const __m512i c = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + o * K + k0)));
    const __m512i low = _mm512_permutex2var_epi16(_mm512_loadu_si512(t), c, _mm512_loadu_si512(t + 32));
    const __m512i high = _mm512_permutex2var_epi16(_mm512_loadu_si512(t + 64), c, _mm512_loadu_si512(t + 96));
    const __m512i mag = _mm512_mask_mov_epi16(low, _mm512_test_epi16_mask(c, _mm512_set1_epi16(0x40)), high);
    // mag ^ (c << 8 & 0x8000): a negative scale_inv's table holds negative values
    return _mm512_ternarylogic_epi32(mag, _mm512_slli_epi16(c, 8), _mm512_set1_epi16(static_cast<int16_t>(0x8000)),
                                     0x78);
  }
  // group-scaled form (below): S = the block's scale_inv * 2^8, V = the code's value * 2^-8, exact in bf16 (raw32)
  inline bool raw_ok(int64_t /*rows*/) const { return true; }
  static constexpr bool kRawUnstaged = true;
  inline int raw_shift() const { return 7; }
  inline int64_t raw_rows() const { return 32; }  // (use_raw_pairs; Int4Rows::raw_rows)
  MOETUNE_AVX512 inline __m512 scales16(int64_t o, int64_t k0, __mmask16 m) const {
    // the grid row: o >> 7 before seg, seg_grid + ((o - seg) >> 7) from it
    const __m512i r = rows16(o), cut = _mm512_set1_epi32(static_cast<int>(seg));
    const __m512i after = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(seg_grid)),
                                           _mm512_srli_epi32(_mm512_sub_epi32(r, cut), 7));
    const __m512i row = _mm512_mask_mov_epi32(_mm512_srli_epi32(r, 7), _mm512_cmpge_epi32_mask(r, cut), after);
    const __m512i idx = _mm512_add_epi32(_mm512_mullo_epi32(row, _mm512_set1_epi32(static_cast<int>(cols))),
                                         _mm512_set1_epi32(static_cast<int>(k0 >> 7)));
    return _mm512_mul_ps(_mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, idx, scale_inv, 4), _mm512_set1_ps(256.0f));
  }
  template <class F>
  MOETUNE_AVX512 MOETUNE_ALWAYS_INLINE void raw_rows(int64_t o0, int64_t k0, int64_t valid, F&& f) const {
    const int8_t* p = codes + o0 * K + k0;
    const int64_t step = K;
    auto addr = [=](int64_t i) { return static_cast<const void*>(p + i * step); };
    if (valid < 32) {  // K's last, partial 32: the bytes past K load as code 0 (+0)
      const __mmask32 m = first32(valid);
      f([=](int64_t i) MOETUNE_AVX512 { return raw32(_mm256_maskz_loadu_epi8(m, p + i * step)); }, addr);
      return;
    }
    f([=](int64_t i) MOETUNE_AVX512 {
      return raw32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i * step)));
    }, addr);
  }
  // V for the 32 codes in b: each code's value * 2^-8 in bf16, exact, by integer operations alone (the conversions
  // through fp16 and fp32 they replace cost 1.2-1.4x in the backward at 8 rows: docs/performance.md, "fp8_block: the
  // codes' values by integer operations"). A code's magnitude bits moved to bf16's exponent and mantissa fields
  // (shifted left 4) give its exponent e (bias 7) where bf16 wants e + 112 (bias 127, times 2^-8): 112 = 0x3800 >> 7
  // sets bits 11-13, which the moved bits (4-10) never reach, so an OR adds it. Subnormal codes (e = 0: m * 2^-9,
  // V = m * 2^-17) from an 8-entry table on their 3 mantissa bits; the sign (bit 15 of the sign-extended code) last.
  MOETUNE_AVX512 static MOETUNE_ALWAYS_INLINE __m512i raw32(__m256i b) {
    const __m512i h = _mm512_cvtepi8_epi16(b);
    const __m512i normal = _mm512_ternarylogic_epi32(_mm512_slli_epi16(h, 4), _mm512_set1_epi16(0x07F0),
                                                     _mm512_set1_epi16(0x3800), 0xEA);  // (a & b) | c
    const __m512i subnormal =
        _mm512_zextsi128_si512(_mm_setr_epi16(0, 0x3700, 0x3780, 0x37C0, 0x3800, 0x3820, 0x3840, 0x3860));
    const __m512i mag =
        _mm512_mask_permutexvar_epi16(normal, _mm512_testn_epi16_mask(h, _mm512_set1_epi16(0x78)), h, subnormal);
    return _mm512_ternarylogic_epi32(mag, h, _mm512_set1_epi16(static_cast<int16_t>(0x8000)), 0xF8);  // a | (b & c)
  }
  // the grid row of W's row o (its row of 128 x 128 blocks in scale_inv), and the index of W[o, k0]'s block
  inline int64_t grid_row(int64_t o) const { return o < seg ? o >> 7 : seg_grid + ((o - seg) >> 7); }
  // the first row past o in another grid row (grid_row's boundaries: multiples of 128 up to seg, seg, seg + 128 m)
  inline int64_t grid_end(int64_t o) const {
    return o < seg ? std::min(seg, ((o >> 7) + 1) << 7) : seg + ((((o - seg) >> 7) + 1) << 7);
  }
  inline int64_t block(int64_t o, int64_t k0) const { return grid_row(o) * cols + (k0 >> 7); }
  // the block's scale_inv times 2^8 = 2^(fp16 bias 15 - e4m3 bias 7)
  inline float mult(int64_t o, int64_t k0) const { return scale_inv[block(o, k0)] * 256.0f; }
  inline const void* code(int64_t o, int64_t k) const { return codes + o * K + k; }
};

// An Fp8BlockRows' values V (code * 2^-8, exact in bf16: its group-scaled form) as a decoder, no scales: for a
// product whose other operand carries the block scales instead (the AVX512 forward with few rows, avx512_gemm.cpp)
struct Fp8Values {
  const Fp8BlockRows& fp8;
  MOETUNE_AVX512 MOETUNE_ALWAYS_INLINE __m512i bf16x32(int64_t o, int64_t k0) const {
    return Fp8BlockRows::raw32(_mm256_loadu_si256(static_cast<const __m256i*>(fp8.code(o, k0))));
  }
  // (a row's partial tail only: bf16_chunk takes bf16x32 for whole chunks)
  MOETUNE_AVX512 inline __m512 operator()(int64_t o, int64_t k0, int valid) const {
    if (valid <= 0) return _mm512_setzero_ps();
    const __m256i b = _mm256_maskz_loadu_epi8(first32(std::min(valid, 16)), fp8.code(o, k0));  // 0: +0
    const __m256i v = _mm512_castsi512_si256(Fp8BlockRows::raw32(b));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
  }
  inline const void* code(int64_t o, int64_t k) const { return fp8.code(o, k); }
};

// Fp8BlockRows' table: for each of `count` blocks' scale_inv s, the bf16 values of the 128 magnitude codes
// m = 0 .. 127 times s (dst[128 i + m]), computed as its operator() computes them (m's bits in fp16, widened, times
// s * 2^8, rounded to nearest even), so that a lookup gives the same bits.
MOETUNE_AVX512 inline void fp8_tables(const float* scale_inv, int64_t count, uint16_t* dst) {
  const __m256i m16 = _mm256_setr_epi16(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t i = 0; i < count; ++i) {
    const __m512 mult = _mm512_set1_ps(scale_inv[i] * 256.0f);
    for (int m0 = 0; m0 < 128; m0 += 16) {
      const __m256i h = _mm256_slli_epi16(_mm256_add_epi16(m16, _mm256_set1_epi16(static_cast<int16_t>(m0))), 7);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 128 * i + m0),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_cvtph_ps(h), mult)));
    }
  }
}

// mxfp4: W[o, k] = FP4[e2m1 code] * 2^(s - 127), s the e8m0 scale byte of k's block of 32 (exact in fp32).
struct Mxfp4Rows {
  const uint8_t* packed;  // [O, K/2]: byte j holds element 2j (low nibble) and 2j + 1 (high nibble)
  const uint8_t* scale;  // [O, K/32]
  int64_t half, blocks;  // K/2, K/32
  MOETUNE_AVX512 inline __m512 operator()(int64_t o, int64_t k0, int valid) const {
    // K is a multiple of 32 and k0 of 16, so valid is >= 16 or <= 0: whole loads, no masks
    if (valid <= 0) return _mm512_setzero_ps();
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(packed + o * half + k0 / 2));
    const __m128i nib = _mm_set1_epi8(0x0F);
    // codes in element order: low nibble of byte 0, its high nibble, low nibble of byte 1, ...
    const __m128i c = _mm_unpacklo_epi8(_mm_and_si128(b, nib), _mm_and_si128(_mm_srli_epi16(b, 4), nib));
    const __m512 v = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(c), fp4());
    return _mm512_mul_ps(v, _mm512_set1_ps(pow2(o, k0)));
  }
  // FP4[code] * s for the 8 codes at p (4 bytes, low nibble first), s broadcast
  MOETUNE_AVX2 static MOETUNE_ALWAYS_INLINE __m256 decode8(const uint8_t* p, __m256 s) {
    uint32_t b;
    std::memcpy(&b, p, 4);
    // element j's code: nibble j of the 32 bits (low nibble first)
    const __m256i c = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(b)),
                                                         _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                                       _mm256_set1_epi32(0x0F));
    // magnitude FP4[c & 7] from an 8-entry table, the sign bit (c & 8) moved to bit 31
    const __m256 mag = _mm256_permutevar8x32_ps(_mm256_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f), c);
    const __m256 sign = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(c, 3), 31));
    return _mm256_mul_ps(_mm256_or_ps(mag, sign), s);
  }
  MOETUNE_AVX2 inline __m256 eight(int64_t o, int64_t k0, int valid) const {
    if (valid <= 0) return _mm256_setzero_ps();  // K is a multiple of 32: valid >= 8 or <= 0
    return decode8(packed + o * half + k0 / 2, _mm256_set1_ps(pow2(o, k0)));
  }
  MOETUNE_AVX2 inline void span8(int64_t o, int64_t k0, int64_t cols, float* dst) const {
    for (int64_t c = 0; c < cols;) {  // one run per block of 32
      const int64_t end = std::min(cols, c + 32 - ((k0 + c) & 31));
      const __m256 sc = _mm256_set1_ps(pow2(o, k0 + c));
      for (; c < end; c += 8) _mm256_storeu_ps(dst + c, decode8(packed + o * half + (k0 + c) / 2, sc));
    }
  }
  MOETUNE_AVX512 MOETUNE_ALWAYS_INLINE __m512i bf16x32(int64_t o, int64_t k0) const {  // one block of 32: one table
    const __m512i table = table16(_mm512_mul_ps(fp4(), _mm512_set1_ps(pow2(o, k0))));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed + o * half + k0 / 2));
    const __m128i nib = _mm_set1_epi8(0x0F), lo = _mm_and_si128(b, nib), hi = _mm_and_si128(_mm_srli_epi16(b, 4), nib);
    // element order: low nibble of byte 0, its high nibble, low nibble of byte 1, ...
    const __m256i codes = _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi));
    return lookup32(codes, table);
  }
  // group-scaled form (below): S = 2^(s - 127), V = FP4[code] (g * S is exact where it stays a normal bf16: the same
  // products as the weights' own values)
  inline bool raw_ok(int64_t /*rows*/) const { return true; }
  static constexpr bool kRawUnstaged = true;
  inline int raw_shift() const { return 5; }
  inline int64_t raw_rows() const { return 8; }  // (use_raw_pairs; 16 measured 0.92-1.07x at 9-16 rows)
  MOETUNE_AVX512 inline __m512 scales16(int64_t o, int64_t k0, __mmask16 m) const {
    const __m512i idx = _mm512_add_epi32(_mm512_mullo_epi32(rows16(o), _mm512_set1_epi32(static_cast<int>(blocks))),
                                         _mm512_set1_epi32(static_cast<int>(k0 >> 5)));
    const __m512i s = gather_u8(scale, idx, m);  // as pow2: s << 23, the subnormal 2^-127 for s = 0
    const __m512i bits = _mm512_mask_mov_epi32(_mm512_slli_epi32(s, 23), _mm512_testn_epi32_mask(s, s),
                                               _mm512_set1_epi32(0x00400000));
    return _mm512_maskz_mov_ps(m, _mm512_castsi512_ps(bits));
  }
  template <class F>
  MOETUNE_AVX512 MOETUNE_ALWAYS_INLINE void raw_rows(int64_t o0, int64_t k0, int64_t /*valid: K % 32 == 0*/,
                                                     F&& f) const {
    const uint8_t* p = packed + o0 * half + k0 / 2;
    const int64_t step = half;
    const __m512i table = table16(fp4());
    auto addr = [=](int64_t i) { return static_cast<const void*>(p + i * step); };
    f(
        [=](int64_t i) MOETUNE_AVX512 {
          // byte j (codes 2j low, 2j + 1 high) -> 32-bit lane j, its two codes as 16-bit words: element order
          const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i * step)));
          const __m512i w = _mm512_ternarylogic_epi32(_mm512_and_si512(d, _mm512_set1_epi32(0x0F)),
                                                      _mm512_slli_epi32(d, 12), _mm512_set1_epi32(0x000F0000), 0xF8);
          return _mm512_permutexvar_epi16(w, table);
        },
        addr);
  }
  // FP4[code] for the 16 e2m1 codes (bit 3: the sign)
  MOETUNE_AVX512 static MOETUNE_ALWAYS_INLINE __m512 fp4() {
    return _mm512_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f);
  }
  // 2^(s - 127), s the block's e8m0 byte; s = 0: the subnormal 2^-127
  inline float pow2(int64_t o, int64_t k0) const {
    const uint32_t s = scale[o * blocks + (k0 >> 5)];
    const uint32_t bits = s ? s << 23 : 0x00400000u;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
  inline const void* code(int64_t o, int64_t k) const { return packed + o * half + k / 2; }
};

// W[o, k0 .. k0 + 32) rounded to bf16, zero past K (valid = K - k0): the decoder's table (bf16x32) where it has one
// and the chunk is whole, else two 16-column decodes
template <class Dec, class = void>
struct has_table : std::false_type {};
template <class Dec>
struct has_table<Dec, std::void_t<decltype(std::declval<const Dec&>().bf16x32(0, 0))>> : std::true_type {};

template <class Dec, class = void>
struct has_cached_table : std::false_type {};
template <class Dec>
struct has_cached_table<
    Dec, std::void_t<decltype(std::declval<const Dec&>().bf16x32(0, 0, std::declval<TableCache&>()))>>
    : std::true_type {};

// whether a decoder writes whole rows in bf16 (bf16_row, where its whole_rows())
template <class Dec, class = void>
struct has_bf16_row : std::false_type {};
template <class Dec>
struct has_bf16_row<Dec, std::void_t<decltype(std::declval<const Dec&>().bf16_row(0, nullptr))>> : std::true_type {};

template <class Dec>
MOETUNE_AVX512 MOETUNE_ALWAYS_INLINE __m512i bf16_chunk(const Dec& dec, int64_t o, int64_t k0, int64_t valid) {
  if constexpr (has_table<Dec>::value) {
    if (valid >= 32) return dec.bf16x32(o, k0);
  }
  const int v = static_cast<int>(std::min<int64_t>(valid, 32));
  return (__m512i)_mm512_cvtne2ps_pbh(dec(o, k0 + 16, v - 16), dec(o, k0, v));
}
// the same for a caller walking row o along k: the table of the row's last group kept in `cache` where the decoder
// takes one (int4: a group of 64 or 128 columns is 2 or 4 chunks)
template <class Dec>
MOETUNE_AVX512 MOETUNE_ALWAYS_INLINE __m512i bf16_chunk(const Dec& dec, int64_t o, int64_t k0, int64_t valid,
                                                        TableCache& cache) {
  if constexpr (has_cached_table<Dec>::value) {
    if (valid >= 32) return dec.bf16x32(o, k0, cache);
  }
  return bf16_chunk(dec, o, k0, valid);
}

// Bring the cache line holding W[o, k]'s code towards L1 (Hint _MM_HINT_T0) or into L2 (_MM_HINT_T2). The AVX512
// loops prefetch into L2: on Zen 4 a prefetch into L1 holds one of L1's few miss buffers until memory answers, which
// held a weight's stream to ~16 of the ~27 GB/s one core reads (docs/performance.md, "Prefetching into L2").
template <int Hint, class Dec>
inline void prefetch(const Dec& dec, int64_t o, int64_t k) {
  _mm_prefetch(static_cast<const char*>(dec.code(o, k)), static_cast<_mm_hint>(Hint));
}

// The same for the line holding p, as an instruction the compiler keeps, for loops that do nothing but prefetch:
// GCC 12 deleted such a loop of _mm_prefetch calls for int4's decoder alone (its code() branches on K/2), in the
// AVX2 and the AMX backward. Not for loops that also multiply: this asm in the AVX2 forward's FMA loop made it
// 0.55-0.72x (docs/performance.md, "AVX2: the backward prefetches its next block; prefetches the compiler deleted").
template <int Hint>
MOETUNE_ALWAYS_INLINE void prefetch_line(const void* p) {
  static_assert(Hint == _MM_HINT_T0 || Hint == _MM_HINT_T2, "prefetch_line: T0 or T2");
  if constexpr (Hint == _MM_HINT_T0) {
    asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
  } else {
    asm volatile("prefetcht2 %0" : : "m"(*static_cast<const char*>(p)));
  }
}

}  // namespace moetune
