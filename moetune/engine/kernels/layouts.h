// Operand layouts and output rounding shared by the kernel variants (amx_gemm.cpp, avx512_gemm.cpp).
//
// Pair layout: bf16 dot-product instructions (AMX tdpbf16ps, AVX512 vdpbf16ps) multiply pairs of bf16 values
// in one 32-bit lane. decode_pairs writes the weight W [O, K] of a 32-row, 64-column block with rows o and o + 1
// interleaved in each lane (16 k per 64-byte row); scaled_rows writes g [n, O] (times the fp32 row scale,
// rounded once) in 16-row, 32-column blocks of 1 KiB, each row's 32 o (16 pairs) contiguous.
#pragma once

#include <algorithm>
#include <cstring>

#include "decoders.h"

namespace moetune {

// rows ahead (in 32-row steps) that decode_pairs prefetches down a strip
constexpr int64_t kAheadSteps = 4;

// v (+ the bf16 values at dst) -> dst, rounded once to bf16; lanes past m untouched.
MOETUNE_AVX512 inline void store_row(at::BFloat16* dst, __m512 v, __mmask16 m, bool accumulate) {
  if (accumulate) {
    __m256i old = _mm256_maskz_loadu_epi16(m, dst);
    v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(old), 16)));
  }
  _mm256_mask_storeu_epi16(dst, m, (__m256i)_mm512_cvtneps_pbh(v));
}

// Rows o and o + 1 of W, columns [k0, k0 + 16), interleaved: lane j holds (W[o, k0 + j], W[o + 1, k0 + j]) as
// bf16, zero past O and K.
template <class Dec>
MOETUNE_AVX512 inline __m512bh decode_pair(const Dec& dec, int64_t o, int64_t k0, int64_t K, int64_t O) {
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                              22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const int valid = static_cast<int>(std::min<int64_t>(16, K - k0));
  __m512 lo = o < O ? dec(o, k0, valid) : _mm512_setzero_ps();
  __m512 hi = o + 1 < O ? dec(o + 1, k0, valid) : _mm512_setzero_ps();
  return (__m512bh)_mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

// Rows o and o + 1 of W, columns [k0, k0 + 32), interleaved as decode_pair's: lo columns k0 .. k0 + 16, hi the
// next 16. With a decoder's table (decoders.h's bf16x32) each row's 32 values looked up at once and the two rows
// interleaved by two vpermt2w; else two decode_pairs.
template <class Dec>
MOETUNE_AVX512 MOETUNE_ALWAYS_INLINE void decode_pair32(const Dec& dec, int64_t o, int64_t k0, int64_t K, int64_t O,
                                                        __m512bh& lo, __m512bh& hi) {
  if constexpr (has_table<Dec>::value) {
    if (K - k0 >= 32) {
      const __m512i a = o < O ? dec.bf16x32(o, k0) : _mm512_setzero_si512();
      const __m512i b = o + 1 < O ? dec.bf16x32(o + 1, k0) : _mm512_setzero_si512();
      const __m512i first = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7,
                                             38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
      const __m512i next = _mm512_add_epi16(first, _mm512_set1_epi16(16));
      lo = (__m512bh)_mm512_permutex2var_epi16(a, first, b);
      hi = (__m512bh)_mm512_permutex2var_epi16(a, next, b);
      return;
    }
  }
  lo = decode_pair(dec, o, k0, K, O);
  hi = decode_pair(dec, o, k0 + 16, K, O);
}

// The rows kAheadSteps 32-row steps below step os of the 64-column strip s, towards L1 or into L2 (Hint: decoders.h's
// prefetch): a strip walks down the rows, 32 per step, K bytes apart, and no hardware prefetcher follows that.
template <int Hint, class Dec>
inline void prefetch_strip(const Dec& dec, int64_t os, int64_t s, int64_t O) {
  for (int64_t o = (os + kAheadSteps) * 32; o < std::min<int64_t>((os + kAheadSteps + 1) * 32, O); ++o)
    prefetch<Hint>(dec, o, s * 64);
}

// W' tiles of rows [32 os, 32 os + 32) and columns [64 s, 64 s + 64): dst + q * q_stride is the 16 x 64-byte
// tile of columns 64 s + 16 q, row p holding rows 32 os + 2p and + 1 interleaved (zero past O and K); the rows
// ahead prefetched with Hint.
template <int Hint, class Dec>
MOETUNE_AVX512 inline void decode_pairs(const Dec& dec, int64_t os, int64_t s, int64_t K, int64_t O,
                                        uint16_t* dst, int64_t q_stride) {
  prefetch_strip<Hint>(dec, os, s, O);
  for (int p = 0; p < 16; ++p) {
    const int64_t o = os * 32 + 2 * p;
    for (int q = 0; q < 4; q += 2) {
      __m512bh lo, hi;
      decode_pair32(dec, o, s * 64 + q * 16, K, O, lo, hi);
      _mm512_storeu_si512(dst + q * q_stride + p * 32, (__m512i)lo);
      _mm512_storeu_si512(dst + (q + 1) * q_stride + p * 32, (__m512i)hi);
    }
  }
}

// row[o .. o + 16) widened exactly to fp32 (the first O - o of them; the others 0, not read)
MOETUNE_AVX512 inline __m512 widen16(const at::BFloat16* row, int64_t o, int64_t O) {
  const __m256i b = _mm256_maskz_loadu_epi16(first(static_cast<int>(O - o)), row + o);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

// g_row[o .. o + 16) (the first O - o of them) times row_scale[o ..] where given, rounded once to bf16
MOETUNE_AVX512 inline __m256i scaled16(const at::BFloat16* g_row, int64_t o, int64_t O, const float* row_scale) {
  __m512 v = widen16(g_row, o, O);
  if (row_scale) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(first(static_cast<int>(O - o)), row_scale + o));
  return (__m256i)_mm512_cvtneps_pbh(v);
}

// g [n, O] bf16 -> A tiles [n/16][Opad/32][16][32] bf16, times the fp32 row scale (rounded once), zero-padded.
// Each tile is 1 KiB of contiguous memory (a row-major [n, Opad] copy made every tile load read 16 lines 2 Opad
// bytes apart: 0.93 vs 0.89 ms at n = 64 and 1.91 vs 1.71 ms at n = 128 per [1536, 2048] int8 matrix).
MOETUNE_AVX512 inline void scaled_rows(const at::BFloat16* g, int64_t ldg, int64_t n, int64_t O, int64_t opad,
                                       const float* row_scale, uint16_t* dst) {
  const int64_t padded = (n + 15) / 16 * 16;
  std::memset(dst, 0, sizeof(uint16_t) * padded * opad);
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t o = 0; o < O; o += 16) {
      const int64_t at = (((r / 16) * (opad / 32) + o / 32) * 16 + r % 16) * 32 + o % 32;
      _mm256_mask_storeu_epi16(dst + at, first(static_cast<int>(O - o)), scaled16(g + r * ldg, o, O, row_scale));
    }
  }
}

}  // namespace moetune
