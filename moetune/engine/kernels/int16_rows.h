// int8 weights against 16-bit integer activations on AVX512-VNNI (the AVX512-BF16 variant's int8 products):
// vpdpwssd multiplies pairs of int16 values and adds them into exact int32 lanes, so a weight's codes only widen
// (vpmovsxbw: one instruction per 32 codes) where the bf16 dot products need each code converted to fp32 and rounded
// to bf16 (five per 32 codes, and a cross-lane interleave in the backward).
//
//   the rows: each row r of the activations (x in the forward; g times the weight's fp32 row scales in the
//             backward) as q[r, c] = round(a[r, c] * inv_r) (ties to even, saturated to +-qmax), inv_r = qmax /
//             max_c |a[r, c]| in fp32, and step_r = max_c |a[r, c]| / qmax, so a[r, c] ~ step_r * q[r, c]: off by at
//             most half a step (2^-16 of the row's largest magnitude with qmax = 32767), where the bf16 path rounds
//             the backward's g * scale to 8 significant bits (2^-9 of each value) and takes the forward's x as it is.
//             A row with a nan or an infinity gets step nan: its products are nan, as the float product's would be.
//   forward : out[n, O] (+)= (step_r * sum_k q[r, k] codes[o, k]) * scale[o]; lanes along k, two weight rows at a
//             time against up to 8 rows of x (avx512_gemm.cpp's forward_rows, with integer lanes); each int32 lane
//             sums 2 ceil(K / 32) products of at most qmax * 128, so qmax = min(32767, (2^31 - 1) / (256 ceil(K /
//             32))) keeps it exact (32767 up to K = 8192; Mixtral's down, K = 14336, 18724).
//   backward: out[n, K] (+)= step_r * sum_o q[r, o] codes[o, k]; few_rows.h's band walk (Int16Pairs below: lanes
//             along k, pairs of weight rows), each band's int32 sums (bands of up to 128 pairs: 256 products a
//             lane at most) added into the fp32 sums once per band and 32 columns, so qmax = 32767 at any O.
//
// int32 sums are exact; their conversion to fp32 and the fp32 sums after it round as the bf16 path's fp32 sums do.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "decoders.h"
#include "few_rows.h"
#include "layouts.h"
#include "rows_layout.h"

namespace moetune_int16 {

using moetune::first;
using moetune::first32;

// the largest |q| for a forward over K columns whose int32 lanes stay exact (see the header)
inline int32_t forward_qmax(int64_t K) {
  const int64_t terms = 2 * ((K + 31) / 32);  // products one lane sums
  return static_cast<int32_t>(std::min<int64_t>(32767, std::numeric_limits<int32_t>::max() / (128 * terms)));
}

using moetune_rows::IntRows;  // rows_layout.h
using moetune_rows::kRowsGrainValues;
using Int16Rows = IntRows<int16_t>;

// One row of int_rows: a's row ar (cols values, times col_scale where given) into dst, its step and its sum. The
// operands by value: the int8 stores (char, which may alias anything) would otherwise make the compiler reload
// every captured operand in the loop (0.75x for int4's a8 backward, measured with the rows over threads)
template <class T, class Src>
MOETUNE_AVX512 inline void int_row(const Src* ar, int64_t cols, const float* col_scale, int32_t qmax, T* dst,
                                   float& step, int32_t& sum) {
  auto value = [&](int64_t c) MOETUNE_AVX512 {  // ar[c .. c + 16) (times the scales), 0 past cols
    __m512 v;  // a's rows in bf16 or fp32
    if constexpr (std::is_same_v<Src, float>)
      v = _mm512_maskz_loadu_ps(first(static_cast<int>(cols - c)), ar + c);
    else
      v = moetune::widen16(ar, c, cols);
    if (col_scale) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(first(static_cast<int>(cols - c)), col_scale + c));
    return v;
  };
  __m512 top = _mm512_setzero_ps();
  __mmask16 bad = 0;  // lanes that saw a nan (max_ps would drop it)
  for (int64_t c = 0; c < cols; c += 16) {
    const __m512 v = value(c);
    bad |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    top = _mm512_max_ps(top, _mm512_abs_ps(v));
  }
  const float m = _mm512_reduce_max_ps(top);
  const float q = static_cast<float>(qmax);
  step = bad || std::isinf(m) ? std::numeric_limits<float>::quiet_NaN() : m / q;
  const __m512 inv = _mm512_set1_ps(m > 0 && std::isfinite(m) ? q / m : 0.0f);
  const __m512i lim = _mm512_set1_epi32(qmax);
  __m512i total = _mm512_setzero_si512();
  for (int64_t c = 0; c < cols; c += 16) {
    __m512i i = _mm512_cvtps_epi32(_mm512_mul_ps(value(c), inv));  // nearest, ties to even (MXCSR's default)
    if (sizeof(T) == 2 || qmax < 127)  // (int8 at 127: the saturating conversion below clamps)
      i = _mm512_max_epi32(_mm512_min_epi32(i, lim), _mm512_sub_epi32(_mm512_setzero_si512(), lim));
    total = _mm512_add_epi32(total, i);
    if constexpr (sizeof(T) == 2)
      _mm256_mask_storeu_epi16(dst + c, first(static_cast<int>(cols - c)), _mm512_cvtepi32_epi16(i));
    else
      _mm_mask_storeu_epi8(dst + c, first(static_cast<int>(cols - c)), _mm512_cvtsepi32_epi8(i));
  }
  sum = _mm512_reduce_add_epi32(total);
}

// Rows of a [n, cols] (times col_scale[c] in fp32 where given) as integers of T (int16_t here, int8_t for
// int8_rows.h), the header's rounding with T's qmax: IntRows with 64-byte lines, step [n] and sum [n] (each row's
// integers summed, exactly)
template <class T, class Src>
MOETUNE_AVX512 inline IntRows<T> int_rows(const Src* a, int64_t lda, int64_t n, int64_t cols, const float* col_scale,
                                          int32_t qmax) {
  IntRows<T> rows = moetune_rows::int_rows_layout<T>(n, cols, 64);
  moetune_rows::each_row(n, cols, [&](int64_t r) MOETUNE_AVX512 {
    int_row(a + r * lda, cols, col_scale, qmax, rows.row(r), rows.step[r], rows.sum[r]);
  });
  return rows;
}

// forward_rows prefetches the weight rows this many pairs ahead (a line per 64 columns, as it reaches them)
constexpr int kAheadPairs = 2;

// res[r * 16 + j] = sum_k x[r, k] codes[o0 + j, k] (the exact int32 lane sums, in fp32) for r < R and j < rows
// weight rows from o0, x's rows ldx apart (64-byte aligned, zeros past K to a multiple of 32); rows_ahead: weight
// rows from o0 to O (the prefetched ones stay inside the weight)
template <int R>
MOETUNE_AVX512 void forward_rows(const moetune::Int8Rows& dec, const int16_t* x, int64_t ldx, int64_t K, int64_t o0,
                                 int rows, float* res, int rows_ahead) {
  for (int j = 0; j < rows; j += 2) {
    const bool two = j + 1 < rows;
    const int8_t* w0 = dec.codes + (o0 + j) * K;
    const int8_t* w1 = two ? w0 + K : w0;
    __m512i acc0[R], acc1[R];
    for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm512_setzero_si512();
    auto step = [&](int64_t k0, int valid) MOETUNE_AVX512 {
      if (k0 % 64 == 0 && j + 2 * kAheadPairs + 1 < rows_ahead) {  // the rows kAheadPairs ahead, this column
        _mm_prefetch(reinterpret_cast<const char*>(w0 + 2 * kAheadPairs * K + k0), _MM_HINT_T2);
        _mm_prefetch(reinterpret_cast<const char*>(w0 + (2 * kAheadPairs + 1) * K + k0), _MM_HINT_T2);
      }
      __m256i a, b;
      if (valid >= 32) {
        a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w0 + k0));
        b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w1 + k0));
      } else {  // K's last, partial 32: zeros past K
        a = _mm256_maskz_loadu_epi8(first32(valid), w0 + k0);
        b = _mm256_maskz_loadu_epi8(first32(valid), w1 + k0);
      }
      const __m512i wa = _mm512_cvtepi8_epi16(a), wb = _mm512_cvtepi8_epi16(b);
      for (int r = 0; r < R; ++r) {
        const __m512i xr = _mm512_load_si512(x + r * ldx + k0);
        acc0[r] = moetune_few_rows::dpwssd(acc0[r], xr, wa);
        acc1[r] = moetune_few_rows::dpwssd(acc1[r], xr, wb);
      }
    };
    int64_t k0 = 0;
    for (; k0 + 32 <= K; k0 += 32) step(k0, 32);
    if (k0 < K) step(k0, static_cast<int>(K - k0));
    __m512 s0[R], s1[R];
    for (int r = 0; r < R; ++r) {
      s0[r] = _mm512_cvtepi32_ps(acc0[r]);
      s1[r] = _mm512_cvtepi32_ps(acc1[r]);
    }
    moetune_few_rows::pair_sums<R>(s0, s1, two, res, j);
  }
}

// out[n, O] columns [16 ob0, 16 ob1) (+)= each 16 weight rows' [n, 16] fp32 sums (sums(o0, rows, acc): rows weight
// rows from o0, acc [n, 16] 64-byte aligned) times step[r] and row_scale[o]: the integer rows' forwards (this
// header's and int8_rows.h's)
template <class Sums>
MOETUNE_AVX512 inline void scaled_blocks(const float* row_scale, const float* step, int64_t n, int64_t O,
                                         at::BFloat16* out, int64_t ldo, bool accumulate, int64_t ob0, int64_t ob1,
                                         Sums&& sums) {
  std::vector<float> res(std::max<int64_t>(n, 8) * 16 + 16);  // [n, 16] fp32 sums
  float* acc = res.data() + (16 - reinterpret_cast<uintptr_t>(res.data()) / 4 % 16) % 16;  // 64-byte aligned
  for (int64_t ob = ob0; ob < ob1; ++ob) {
    const int64_t o0 = ob * 16;
    const int rows = static_cast<int>(std::min<int64_t>(16, O - o0));
    const __mmask16 m = first(rows);
    const __m512 scale = _mm512_maskz_loadu_ps(m, row_scale + o0);
    sums(o0, rows, acc);
    for (int64_t r = 0; r < n; ++r)
      moetune::store_row(out + r * ldo + o0,
                         _mm512_mul_ps(_mm512_load_ps(acc + r * 16), _mm512_mul_ps(scale, _mm512_set1_ps(step[r]))),
                         m, accumulate);
  }
}

// forward for output columns (weight rows) [16 ob0, 16 ob1): x's rows (int16_rows) against the codes, 8 rows of x
// at a time, times x's steps and the weight's row scales on the fp32 sums
MOETUNE_AVX512 inline void forward_range(const moetune::Int8Rows& dec, const float* row_scale, const Int16Rows& x,
                                         int64_t n, int64_t K, int64_t O, at::BFloat16* out, int64_t ldo,
                                         bool accumulate, int64_t ob0, int64_t ob1) {
  scaled_blocks(row_scale, x.step.data(), n, O, out, ldo, accumulate, ob0, ob1,
                [&](int64_t o0, int rows, float* acc) MOETUNE_AVX512 {
                  for (int64_t r0 = 0; r0 < n; r0 += 8)
                    moetune_few_rows::with_rows<8>(n - r0, [&](auto R) MOETUNE_AVX512 {
                      forward_rows<decltype(R)::value>(dec, x.row(r0), x.ld, K, o0, rows, acc + r0 * 16,
                                                       static_cast<int>(O - o0));
                    });
                });
}

// Rows o and o + 1 of the codes (a zero row past O), columns [k0, k0 + 32) (zeros past K: valid = K - k0), widened
// to int16 and interleaved into pairs as few_rows.h's Bf16Pairs (kPermuted), for its band walk with int32 sums
// (kInt16Sums: the pair vectors hold int16 pairs, g's rows are int16_rows', and each row's sums end times step[r])
struct Int16Pairs {
  static constexpr bool kPermuted = true;
  static constexpr bool kStaged = false;  // a widening per 32 codes: nothing worth decoding ahead
  static constexpr bool kInt16Sums = true;
  const moetune::Int8Rows& dec;
  int64_t O;
  const float* step;  // [n]: g's rows' steps
  MOETUNE_AVX512 MOETUNE_ALWAYS_INLINE void operator()(int64_t o, int64_t k0, int64_t valid, __m512bh& lo,
                                                      __m512bh& hi) const {
    const int8_t* p = dec.codes + o * dec.K + k0;
    const __mmask32 m = o + 1 < O ? first32(valid) : 0;  // the second row's lanes
    __m256i a, b;
    if (valid >= 32 && m) {
      a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + dec.K));
    } else {
      a = _mm256_maskz_loadu_epi8(first32(valid), p);
      b = _mm256_maskz_loadu_epi8(m, p + dec.K);
    }
    const __m512i wa = _mm512_cvtepi8_epi16(a), wb = _mm512_cvtepi8_epi16(b);
    lo = (__m512bh)_mm512_unpacklo_epi16(wa, wb);
    hi = (__m512bh)_mm512_unpackhi_epi16(wa, wb);
  }
  inline const void* code(int64_t o, int64_t k) const { return dec.code(o, k); }  // for prefetch_pair
};

// out[n, O] (+)= x[n, K] @ (diag(row_scale) codes)^T, the header's forward
MOETUNE_AVX512 inline void forward(const moetune::Int8Rows& dec, const float* row_scale, const at::BFloat16* x,
                                   int64_t ldx, int64_t n, int64_t K, int64_t O, at::BFloat16* out, int64_t ldo,
                                   bool accumulate) {
  const Int16Rows xq = int_rows<int16_t>(x, ldx, n, K, nullptr, forward_qmax(K));
  at::parallel_for(0, (O + 15) / 16, 1, [&](int64_t b0, int64_t b1) {
    forward_range(dec, row_scale, xq, n, K, O, out, ldo, accumulate, b0, b1);
  });
}

// out[n, K] (+)= (g[n, O] * row_scale) @ codes, the header's backward
MOETUNE_AVX512 inline void backward(const moetune::Int8Rows& dec, const float* row_scale, const at::BFloat16* g,
                                    int64_t ldg, int64_t n, int64_t K, int64_t O, at::BFloat16* out, int64_t ldo,
                                    bool accumulate) {
  const Int16Rows gq = int_rows<int16_t>(g, ldg, n, O, row_scale, 32767);  // ld: O rounded up to 32, so even
  const Int16Pairs pairs{dec, O, gq.step.data()};
  const auto* gp = reinterpret_cast<const uint16_t*>(gq.row(0));
  const int64_t Oe = (O + 1) / 2 * 2;
  const std::vector<uint16_t> blocks = moetune_few_rows::pair_blocks<Int16Pairs>(gp, gq.ld, n, Oe);
  at::parallel_for(0, (K + 31) / 32, 1, [&](int64_t c0, int64_t c1) {
    moetune_few_rows::backward_range(pairs, gp, gq.ld, n, K, Oe, out, ldo, accumulate, c0, c1,
                                     blocks.empty() ? nullptr : blocks.data());
  });
}

}  // namespace moetune_int16
