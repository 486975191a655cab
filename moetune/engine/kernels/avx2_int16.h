// int8 weights against 16-bit integer activations on AVX2 (the AVX2 variant's int8 products; avx2_gemm.cpp's loops
// run these register blocks where the others run fp32 FMA ones): vpmaddwd multiplies 16 pairs of int16 values and
// adds each pair into an int32 lane, so a weight's codes only widen (vpmovsxbw: one instruction per 16 codes) where
// the fp32 loops convert each code to fp32 (two per 8 codes), and one vpmaddwd + vpaddd does 16 multiply-adds where
// FMA does 8 (Zen 3: 1.45x the multiply-adds per second, measured by a throwaway loop of each).
//
//   the rows: int16_rows.h's rounding: each row r of the activations (x in the forward; g times the weight's fp32
//             row scales in the backward) as q[r, c] = round(a[r, c] * inv_r) (ties to even), inv_r = 32767 /
//             max_c |a[r, c]| in fp32, step_r = max_c |a[r, c]| / 32767, so a[r, c] ~ step_r * q[r, c] within half a
//             step (2^-16 of the row's largest magnitude); a row with a nan or an infinity gets step nan (its
//             products nan, as the fp32 product's would be).
//   forward : out[n, O] (+)= (step_r * sum_k q[r, k] codes[o, k]) * scale[o]; lanes along k (pairs of adjacent
//             columns), the int32 lanes converted to fp32 once per chunk of 512 columns (a lane sums 32 pairs of at
//             most 2 * 32767 * 128: < 2^29, exact), so 32767 serves any K.
//   backward: out[n, K] (+)= step_r * sum_o q[r, o] codes[o, k]; lanes along k, pairs of weight rows (o, o + 1)
//             interleaved in the decoded block (vpunpck{l,h}wd: each 128-bit half holds 4 columns' pairs) against
//             g's pair (q[r, o], q[r, o + 1]) broadcast, the int32 lanes converted to fp32 once per block of at
//             most 128 weight rows (64 pairs: < 2^30, exact).
//
// int32 sums are exact; their conversion to fp32 and the fp32 sums after it round as the fp32 loops' sums do.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "decoders.h"
#include "rows_layout.h"

namespace moetune_avx2_int16 {

// an integer row type's largest step count: int16 32767 (avx2_int16.h's products), int8 127 (avx2_int8.h's)
template <class T>
constexpr int32_t kQmax = sizeof(T) == 1 ? 127 : 32767;
using moetune_rows::IntRows;  // rows_layout.h

// f(std::integral_constant<int, R>{}) with R = min(rows, Max) (Max <= 6): register blocks' row counts as
// template arguments
template <int Max, class F>
MOETUNE_AVX2 inline void with_rows(int64_t rows, F&& f) {
  switch (std::min<int64_t>(Max, rows)) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, std::min(2, Max)>{}); break;
    case 3: f(std::integral_constant<int, std::min(3, Max)>{}); break;
    case 4: f(std::integral_constant<int, std::min(4, Max)>{}); break;
    case 5: f(std::integral_constant<int, std::min(5, Max)>{}); break;
    default: f(std::integral_constant<int, Max>{}); break;
  }
}

// lanes below `valid` (0 .. 8) all ones: maskload's mask
MOETUNE_AVX2 inline __m256i lanes(int valid) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(valid), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// One row of rows_q: ar's cols values (times col_scale) into dst (ld values), its step
template <class T>
MOETUNE_AVX2 inline void row_q(const float* ar, int64_t cols, const float* col_scale, int64_t ld, T* dst,
                               float& step) {
  auto value = [&](int64_t c) MOETUNE_AVX2 {  // ar[c .. c + 8) (times the scales), 0 past cols
    const int valid = static_cast<int>(std::min<int64_t>(8, cols - c));
    if (valid <= 0) return _mm256_setzero_ps();
    const __m256i m = lanes(valid);
    auto load = [&](const float* p) MOETUNE_AVX2 { return valid == 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, m); };
    const __m256 v = load(ar + c);
    return col_scale ? _mm256_mul_ps(v, load(col_scale + c)) : v;
  };
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 top = _mm256_setzero_ps(), bad = _mm256_setzero_ps();  // bad: lanes that saw a nan (max_ps drops it)
  for (int64_t c = 0; c < cols; c += 8) {
    const __m256 v = value(c);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    top = _mm256_max_ps(top, _mm256_andnot_ps(sign, v));
  }
  __m128 t = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
  t = _mm_max_ps(t, _mm_movehl_ps(t, t));
  const float m = _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
  const float q = static_cast<float>(kQmax<T>);
  step = _mm256_movemask_ps(bad) || std::isinf(m) ? std::numeric_limits<float>::quiet_NaN() : m / q;
  const __m256 inv = _mm256_set1_ps(m > 0 && std::isfinite(m) ? q / m : 0.0f);
  // nearest, ties to even (MXCSR's default); |v * inv| <= qmax (1 + 2^-23) rounds to at most qmax, and the
  // saturating packs keep a nan's lane (0x80000000) at the type's lowest value (its row's step is nan)
  auto ints = [&](int64_t c) MOETUNE_AVX2 { return _mm256_cvtps_epi32(_mm256_mul_ps(value(c), inv)); };
  for (int64_t c = 0; c < ld; c += 32 / static_cast<int64_t>(sizeof(T))) {  // a 32-byte vector a step
    auto* out = reinterpret_cast<__m256i*>(dst + c);
    // packs interleaves the 128-bit halves (a0 b0 a1 b1): a permute restores column order
    const __m256i lo = _mm256_packs_epi32(ints(c), ints(c + 8));
    if constexpr (sizeof(T) == 2) {
      _mm256_store_si256(out, _mm256_permute4x64_epi64(lo, 0xD8));
    } else {
      const __m256i hi = _mm256_packs_epi32(ints(c + 16), ints(c + 24));
      // 32-bit words in (c, c + 8, c + 16, c + 24, c + 4, c + 12, c + 20, c + 28) order of their 4 columns
      const __m256i bytes = _mm256_packs_epi16(lo, hi);
      _mm256_store_si256(out, _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    }
  }
}

// a's n rows of cols values (lda apart; times col_scale where given) as IntRows<T> with 32-byte lines (sum not filled),
// spread over the threads (inside a parallel region: on the calling thread)
template <class T>
MOETUNE_AVX2 inline IntRows<T> rows_q(const float* a, int64_t lda, int64_t n, int64_t cols, const float* col_scale) {
  IntRows<T> rows = moetune_rows::int_rows_layout<T>(n, cols, 32);
  moetune_rows::each_row(n, cols, [&](int64_t r) MOETUNE_AVX2 {
    row_q(a + r * lda, cols, col_scale, rows.ld, rows.row(r), rows.step[r]);
  });
  return rows;
}

// codes[o, k .. k + 16) widened to int16 (zeros past K)
MOETUNE_AVX2 MOETUNE_ALWAYS_INLINE __m256i widen16(const moetune::Int8Rows& dec, int64_t o, int64_t k) {
  const int8_t* p = dec.codes + o * dec.K + k;
  const int64_t valid = dec.K - k;
  if (valid >= 16) return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  alignas(16) int8_t tail[16] = {};
  if (valid > 0) std::memcpy(tail, p, valid);
  return _mm256_cvtepi8_epi16(_mm_load_si128(reinterpret_cast<const __m128i*>(tail)));
}

// the forward's decoded row: codes[o, k0 .. k0 + cols) as int16 into dst, to a whole number of vectors (zeros past K)
MOETUNE_AVX2 inline void decode_row(const moetune::Int8Rows& dec, int64_t o, int64_t k0, int64_t cols, int16_t* dst) {
  for (int64_t c = 0; c < cols; c += 16)
    _mm256_store_si256(reinterpret_cast<__m256i*>(dst + c), widen16(dec, o, k0 + c));
}

// the backward's decoded block: weight rows o0 .. o0 + rows (a missing partner row: zeros), columns k0 .. k0 + cols
// (whole 16s; zeros past K) as pairs, pair p at w + p * ldw, columns c .. c + 16 at + 2c: 16 int16 (c .. c + 3,
// c + 8 .. c + 11, each row o's value then row o + 1's), then 16 more (c + 4 .. c + 7, c + 12 .. c + 15)
MOETUNE_AVX2 inline void decode_pairs(const moetune::Int8Rows& dec, int64_t o0, int rows, int64_t k0, int64_t cols,
                                      int16_t* w, int64_t ldw) {
  for (int p = 0; 2 * p < rows; ++p) {
    const bool partner = 2 * p + 1 < rows;
    for (int64_t c = 0; c < cols; c += 16) {
      const __m256i a = widen16(dec, o0 + 2 * p, k0 + c);
      const __m256i b = partner ? widen16(dec, o0 + 2 * p + 1, k0 + c) : _mm256_setzero_si256();
      auto* dst = reinterpret_cast<__m256i*>(w + p * ldw + 2 * c);
      _mm256_store_si256(dst, _mm256_unpacklo_epi16(a, b));
      _mm256_store_si256(dst + 1, _mm256_unpackhi_epi16(a, b));
    }
  }
}

MOETUNE_AVX2 inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// res[r * J + j] += sum over cols (whole 16s) of x[r, c] w[j * ldw + c] for r < R, j < J (x's rows ldx apart,
// 32-byte aligned), the int32 lanes to fp32 at the end; ahead(i) at the i-th 16 columns (the caller's prefetch).
// Not inlined: GCC 12 inlined the 1-row block (an odd count's last row) into forward_range and kept its 4 sums on
// the stack, a load and a store per product; as a function of its own they stay in registers (1.05-1.33x the
// forward at 1-7 odd rows, bench/kernel_ab.py on Zen 3)
template <int R, int J, class Ahead>
MOETUNE_AVX2 __attribute__((noinline)) void forward_block(const int16_t* w, int64_t ldw, const int16_t* x,
                                                          int64_t ldx, int64_t cols, float* res, Ahead&& ahead) {
  __m256i acc[R][J];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) acc[r][j] = _mm256_setzero_si256();
  for (int64_t c = 0; c < cols; c += 16) {
    ahead(c / 16);
    __m256i xr[R];
    for (int r = 0; r < R; ++r) xr[r] = _mm256_load_si256(reinterpret_cast<const __m256i*>(x + r * ldx + c));
    for (int j = 0; j < J; ++j) {
      const __m256i wj = _mm256_load_si256(reinterpret_cast<const __m256i*>(w + j * ldw + c));
      for (int r = 0; r < R; ++r) acc[r][j] = _mm256_add_epi32(acc[r][j], _mm256_madd_epi16(xr[r], wj));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) res[r * J + j] += hsum(_mm256_cvtepi32_ps(acc[r][j]));
}

// acc[r][0 .. 32) += sum over the rows of q[r, o] w[o, 0 .. 32) for r < R: w 32 columns of a decode_pairs block
// (pair p at w + p * ldw), g's row r at g + r * ldg (already at the block's first row; its pair (o, o + 1) one
// int32), acc's row r at acc + r * lda (fp32, column order); 16 columns per pass
template <int R>
MOETUNE_AVX2 void backward_block(const int16_t* w, int64_t ldw, int rows, const int16_t* g, int64_t ldg, float* acc,
                                 int64_t lda) {
  const int pairs = (rows + 1) / 2;
  for (int h = 0; h < 32; h += 16) {
    __m256i c0[R], c1[R];
    for (int r = 0; r < R; ++r) c0[r] = c1[r] = _mm256_setzero_si256();
    for (int p = 0; p < pairs; ++p) {
      const auto* wp = reinterpret_cast<const __m256i*>(w + p * ldw + 2 * h);
      const __m256i w0 = _mm256_load_si256(wp), w1 = _mm256_load_si256(wp + 1);
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, g + r * ldg + 2 * p, sizeof pair);
        const __m256i b = _mm256_set1_epi32(pair);
        c0[r] = _mm256_add_epi32(c0[r], _mm256_madd_epi16(b, w0));
        c1[r] = _mm256_add_epi32(c1[r], _mm256_madd_epi16(b, w1));
      }
    }
    for (int r = 0; r < R; ++r) {  // c0: columns 0-3 | 8-11, c1: 4-7 | 12-15
      const __m256 lo = _mm256_cvtepi32_ps(c0[r]), hi = _mm256_cvtepi32_ps(c1[r]);
      float* dst = acc + r * lda + h;
      _mm256_storeu_ps(dst, _mm256_add_ps(_mm256_loadu_ps(dst), _mm256_permute2f128_ps(lo, hi, 0x20)));
      _mm256_storeu_ps(dst + 8, _mm256_add_ps(_mm256_loadu_ps(dst + 8), _mm256_permute2f128_ps(lo, hi, 0x31)));
    }
  }
}

}  // namespace moetune_avx2_int16
