// int8 weights against 8-bit integer activations on AVX512-VNNI (the opt-in int8 activations of the int8 format,
// formats/int8.py): vpdpbusd multiplies four unsigned bytes by four signed bytes and adds the four products into an
// exact int32 lane, 64 products per instruction where int16_rows.h's vpdpwssd makes 32 and the bf16 dot products 32.
//
//   the rows: each row r of the activations (x in the forward; g times the weight's fp32 row scales in the
//             backward) as q[r, c] = round(a[r, c] * inv_r), saturated to +-127 (int16_rows.h's int_rows with qmax
//             127): a[r, c] ~ step_r * q[r, c], off by at most half a step, 1/254 of the row's largest magnitude
//             (int16_rows.h's default: 1/65534). That is the precision given up for the speed; the products after
//             it are exact.
//   the codes: the unsigned operand is a weight code plus 128 (an xor of its sign bit: 0 .. 255), so each sum
//             carries 128 times the sum of the row's q, known from the quantization (IntRows::sum) and taken off:
//             sum_k q[r, k] codes[o, k] = sum_k q[r, k] (codes[o, k] + 128) - 128 sum_k q[r, k].
//   forward : out[n, O] (+)= (step_r * sum_k q[r, k] codes[o, k]) * scale[o]; lanes along k, 64 columns a step, two
//             weight rows at a time against up to 8 rows of x, each row's accumulators started at -8 sum_r in every
//             lane (16 lanes: the -128 sum_r), summed across their lanes in fp32 at the end (pair_sums). A lane holds
//             at most 8 * 127 K + (K / 16) * 255 * 127 in magnitude: exact in int32 for any K below 10^6; in fp32
//             (its conversion and the 16-lane sum) it rounds as the bf16 path's fp32 sums do.
//   backward: out[n, K] (+)= step_r * sum_o q[r, o] codes[o, k]; lanes along k, four weight rows interleaved into
//             quads per lane (quads below), g's four values q[r, o .. o + 4) broadcast; bands of 32 quads staged once
//             for all rows of g, the int32 sums of every band kept in an int32 buffer: a lane sums O products of at
//             most 255 * 127, exact for O <= kMaxO (int8_gemm_a8 checks), converted once at the end.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "decoders.h"
#include "few_rows.h"
#include "int16_rows.h"
#include "layouts.h"

namespace moetune_int8 {

using moetune::first;
using Int8Acts = moetune_int16::IntRows<int8_t>;

// the most weight rows (O) whose backward int32 lanes stay exact: O * 255 * 127 < 2^31
constexpr int64_t kMaxO = 66311;
// weight rows prefetched ahead in the forward (pairs), as int16_rows.h's
constexpr int kAheadPairs = 2;
// the backward's band: quads of weight rows staged per 64 columns (32: 128 rows, 8 KiB)
constexpr int kBandQuads = 32;

// acc + u . s (vpdpbusd: per 32-bit lane, four unsigned bytes of u times four signed bytes of s, summed into acc);
// through asm for the reason few_rows.h's dpwssd gives
MOETUNE_ALWAYS_INLINE __m512i dpbusd(__m512i acc, __m512i u, __m512i s) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
  return acc;
}

// the first `valid` of 64 byte lanes
MOETUNE_AVX512 inline __mmask64 first64(int64_t valid) {
  return valid >= 64 ? ~(__mmask64)0 : (__mmask64)((1ull << (valid > 0 ? valid : 0)) - 1ull);
}

// 64 codes from p (zeros past valid) plus 128, as unsigned bytes
MOETUNE_AVX512 MOETUNE_ALWAYS_INLINE __m512i biased64(const int8_t* p, int64_t valid) {
  const __m512i v = valid >= 64 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8(first64(valid), p);
  return _mm512_xor_si512(v, _mm512_set1_epi8(-128));
}

// res[r * 16 + j] = sum_k q[r, k] codes[o0 + j, k] (in fp32) for r < R and j < rows weight rows from o0; x's rows
// ldx apart (64-byte aligned, zeros past K to a whole line), sum[r] their sums; rows_ahead: weight rows from o0 to O
template <int R>
MOETUNE_AVX512 void forward_rows(const moetune::Int8Rows& dec, const int8_t* x, int64_t ldx, const int32_t* sum,
                                 int64_t K, int64_t o0, int rows, float* res, int rows_ahead) {
  for (int j = 0; j < rows; j += 2) {
    const bool two = j + 1 < rows;
    const int8_t* w0 = dec.codes + (o0 + j) * K;
    const int8_t* w1 = two ? w0 + K : w0;
    __m512i acc0[R], acc1[R];
    for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm512_set1_epi32(-8 * sum[r]);  // 16 lanes: -128 sum[r]
    auto step = [&](int64_t k0, int64_t valid) MOETUNE_AVX512 {
      if (j + 2 * kAheadPairs + 1 < rows_ahead) {  // the rows kAheadPairs ahead, this line
        _mm_prefetch(reinterpret_cast<const char*>(w0 + 2 * kAheadPairs * K + k0), _MM_HINT_T2);
        _mm_prefetch(reinterpret_cast<const char*>(w0 + (2 * kAheadPairs + 1) * K + k0), _MM_HINT_T2);
      }
      const __m512i a = biased64(w0 + k0, valid), b = biased64(w1 + k0, valid);  // past K: 128 against x's zeros
      for (int r = 0; r < R; ++r) {
        const __m512i xr = _mm512_load_si512(x + r * ldx + k0);
        acc0[r] = dpbusd(acc0[r], a, xr);
        acc1[r] = dpbusd(acc1[r], b, xr);
      }
    };
    int64_t k0 = 0;
    for (; k0 + 64 <= K; k0 += 64) step(k0, 64);
    if (k0 < K) step(k0, K - k0);
    __m512 s0[R], s1[R];
    for (int r = 0; r < R; ++r) {
      s0[r] = _mm512_cvtepi32_ps(acc0[r]);
      s1[r] = _mm512_cvtepi32_ps(acc1[r]);
    }
    moetune_few_rows::pair_sums<R>(s0, s1, two, res, j);
  }
}

// out[n, O] (+)= x[n, K] @ (diag(row_scale) codes)^T, the header's forward
MOETUNE_AVX512 inline void forward(const moetune::Int8Rows& dec, const float* row_scale, const at::BFloat16* x,
                                   int64_t ldx, int64_t n, int64_t K, int64_t O, at::BFloat16* out, int64_t ldo,
                                   bool accumulate) {
  const Int8Acts xq = moetune_int16::int_rows<int8_t>(x, ldx, n, K, nullptr, 127);
  at::parallel_for(0, (O + 15) / 16, 1, [&](int64_t ob0, int64_t ob1) MOETUNE_AVX512 {
    std::vector<float> res(std::max<int64_t>(n, 8) * 16 + 16);  // [n, 16] fp32 sums
    float* acc = res.data() + (16 - reinterpret_cast<uintptr_t>(res.data()) / 4 % 16) % 16;  // 64-byte aligned
    for (int64_t ob = ob0; ob < ob1; ++ob) {
      const int64_t o0 = ob * 16;
      const int rows = static_cast<int>(std::min<int64_t>(16, O - o0));
      const __mmask16 m = first(rows);
      const __m512 scale = _mm512_maskz_loadu_ps(m, row_scale + o0);
      for (int64_t r0 = 0; r0 < n; r0 += 8)
        moetune_few_rows::with_rows<8>(n - r0, [&](auto R) MOETUNE_AVX512 {
          forward_rows<decltype(R)::value>(dec, xq.row(r0), xq.ld, xq.sum.data() + r0, K, o0, rows, acc + r0 * 16,
                                           static_cast<int>(O - o0));
        });
      for (int64_t r = 0; r < n; ++r)
        moetune::store_row(out + r * ldo + o0,
                           _mm512_mul_ps(_mm512_load_ps(acc + r * 16), _mm512_mul_ps(scale, _mm512_set1_ps(xq.step[r]))),
                           m, accumulate);
    }
  });
}

// Rows o .. o + 4 of the codes plus 128 (zero rows past O), columns [k0, k0 + 64), as four vectors of quads: lane
// 4 L + i of v[j] holds (W[o, k], .., W[o + 3, k]) + 128 for k = k0 + 16 L + 4 j + i (two rounds of unpacks within
// each 128-bit lane; unquad puts the sums back in column order)
MOETUNE_AVX512 MOETUNE_ALWAYS_INLINE void quads(const moetune::Int8Rows& dec, int64_t O, int64_t o, int64_t k0,
                                                int64_t valid, __m512i v[4]) {
  __m512i w[4];
  for (int i = 0; i < 4; ++i)
    w[i] = o + i < O ? biased64(dec.codes + (o + i) * dec.K + k0, valid) : _mm512_setzero_si512();
  const __m512i t0 = _mm512_unpacklo_epi8(w[0], w[1]), t1 = _mm512_unpackhi_epi8(w[0], w[1]);
  const __m512i t2 = _mm512_unpacklo_epi8(w[2], w[3]), t3 = _mm512_unpackhi_epi8(w[2], w[3]);
  v[0] = _mm512_unpacklo_epi16(t0, t2);
  v[1] = _mm512_unpackhi_epi16(t0, t2);
  v[2] = _mm512_unpacklo_epi16(t1, t3);
  v[3] = _mm512_unpackhi_epi16(t1, t3);
}

// quads' column order undone: a[j] in quads' lanes -> a[L] columns 16 L .. 16 L + 16 (a 4 x 4 transpose of 128-bit
// blocks)
MOETUNE_AVX512 MOETUNE_ALWAYS_INLINE void unquad(__m512i a[4]) {
  const __m512i p0 = _mm512_shuffle_i32x4(a[0], a[1], 0x44), p1 = _mm512_shuffle_i32x4(a[2], a[3], 0x44);
  const __m512i p2 = _mm512_shuffle_i32x4(a[0], a[1], 0xEE), p3 = _mm512_shuffle_i32x4(a[2], a[3], 0xEE);
  a[0] = _mm512_shuffle_i32x4(p0, p1, 0x88);
  a[1] = _mm512_shuffle_i32x4(p0, p1, 0xDD);
  a[2] = _mm512_shuffle_i32x4(p2, p3, 0x88);
  a[3] = _mm512_shuffle_i32x4(p2, p3, 0xDD);
}

// acc rows r < R, 64 columns in quads' order (int32, ldacc apart) += g[r, 4 q .. 4 q + 4) . staged quad q, q < nq
template <int R>
MOETUNE_AVX512 inline void band_rows(const __m512i* staged, int nq, const int8_t* g, int64_t ldg, int32_t* acc,
                                     int64_t ldacc) {
  __m512i s[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) s[r][j] = _mm512_setzero_si512();
  for (int q = 0; q < nq; ++q) {
    const __m512i* w = staged + 4 * q;
    for (int r = 0; r < R; ++r) {
      int32_t quad;
      std::memcpy(&quad, g + r * ldg + 4 * q, 4);
      const __m512i gq = _mm512_set1_epi32(quad);
      for (int j = 0; j < 4; ++j) s[r][j] = dpbusd(s[r][j], w[j], gq);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) {
      int32_t* a = acc + r * ldacc + 16 * j;
      _mm512_storeu_si512(a, _mm512_add_epi32(_mm512_loadu_si512(a), s[r][j]));
    }
}

// out[n, K] (+)= (g[n, O] * row_scale) @ codes, the header's backward
MOETUNE_AVX512 inline void backward(const moetune::Int8Rows& dec, const float* row_scale, const at::BFloat16* g,
                                    int64_t ldg, int64_t n, int64_t K, int64_t O, at::BFloat16* out, int64_t ldo,
                                    bool accumulate) {
  const Int8Acts gq = moetune_int16::int_rows<int8_t>(g, ldg, n, O, row_scale, 127);  // ld: whole lines, >= O + 3
  at::parallel_for(0, (K + 63) / 64, 1, [&](int64_t c0, int64_t c1) MOETUNE_AVX512 {
    const int64_t width = (c1 - c0) * 64 + (n > 4 ? 16 : 0);  // a line more: rows not 4 KiB apart
    std::vector<int32_t> accv(n * width, 0);
    int32_t* acc = accv.data() - c0 * 64;  // acc + r * width + k for k in [64 c0, 64 c1)
    alignas(64) __m512i staged[4 * kBandQuads];
    for (int64_t ob = 0; ob < O; ob += 4 * kBandQuads) {
      const int nq = static_cast<int>(std::min<int64_t>(kBandQuads, (O - ob + 3) / 4));
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t k0 = c * 64;
        for (int q = 0; q < nq; ++q) {
          const int64_t o = ob + 4 * q, ahead = o + 4 * kBandQuads;  // the next band's rows, the same columns
          for (int64_t i = ahead; i < std::min(ahead + 4, O); ++i)
            _mm_prefetch(reinterpret_cast<const char*>(dec.codes + i * K + k0), _MM_HINT_T2);
          quads(dec, O, o, k0, K - k0, staged + 4 * q);
        }
        for (int64_t r0 = 0; r0 < n; r0 += 4)
          moetune_few_rows::with_rows<4>(n - r0, [&](auto R) MOETUNE_AVX512 {
            band_rows<decltype(R)::value>(staged, nq, gq.row(r0) + ob, gq.ld, acc + r0 * width + k0, width);
          });
      }
    }
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t k0 = c * 64;
      for (int64_t r = 0; r < n; ++r) {
        const int32_t* a = acc + r * width + k0;
        const __m512i bias = _mm512_set1_epi32(128 * gq.sum[r]);
        __m512i v[4];
        for (int j = 0; j < 4; ++j) v[j] = _mm512_sub_epi32(_mm512_loadu_si512(a + 16 * j), bias);
        unquad(v);
        const __m512 step = _mm512_set1_ps(gq.step[r]);
        for (int j = 0; j < 4 && k0 + 16 * j < K; ++j)
          moetune::store_row(out + r * ldo + k0 + 16 * j, _mm512_mul_ps(_mm512_cvtepi32_ps(v[j]), step),
                             first(static_cast<int>(K - k0 - 16 * j)), accumulate);
      }
    }
  });
}

}  // namespace moetune_int8
