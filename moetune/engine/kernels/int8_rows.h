// int8 and int4 weights against 8-bit integer activations on AVX512-VNNI (the opt-in int8_activations of the int8
// and int4 formats: entry.h's int8_gemm_a8 / int4_gemm_a8): vpdpbusd multiplies four unsigned bytes by four signed
// bytes and adds the four products into an exact int32 lane, 64 products per instruction where int16_rows.h's
// vpdpwssd makes 32 and the bf16 dot products 32. int8 first; int4 (its own forward and backward) below.
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
//             for all rows of g (each quad's rows prefetched at the band's next 64 columns), the int32 sums of every
//             band kept in an int32 buffer: a lane sums O products of at most 255 * 127, exact for O <= kMaxO
//             (int8_gemm_a8 checks), converted once at the end.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
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

// x's rows as forward_rows takes them: rows_layout.h's row_blocks of 64-byte units (ld: K rounded up to 64 bytes a
// row; block r0 from r0 * ld), in a 64-byte aligned buffer every byte of which is written (xq's rows hold zeros past
// K to a whole line). The 7-row forward ran 1.24-1.51x slower on a pointer per row.
struct RowBlocks {
  std::unique_ptr<int8_t[]> bytes;
  int64_t at = 0, ld = 0;
  const int8_t* block(int64_t r0) const { return bytes.get() + at + r0 * ld; }
};
inline RowBlocks row_blocks(const Int8Acts& xq, int64_t n, int64_t K) {
  RowBlocks b;
  b.ld = (K + 63) / 64 * 64;
  b.bytes.reset(new int8_t[n * b.ld + 64]);
  b.at = static_cast<int64_t>((64 - reinterpret_cast<uintptr_t>(b.bytes.get()) % 64) % 64);
  moetune_rows::row_blocks<64>(xq.row(0), xq.ld, n, b.ld / 64, b.bytes.get() + b.at);
  return b;
}

// res[r * 16 + j] = sum_k q[r, k] codes[o0 + j, k] (in fp32) for r < R and j < rows weight rows from o0; x's R rows
// one block of row_blocks (zeros past K to a whole line), sum[r] their sums; rows_ahead: weight rows from o0 to O
template <int R>
MOETUNE_AVX512 void forward_rows(const moetune::Int8Rows& dec, const int8_t* x, const int32_t* sum, int64_t K,
                                 int64_t o0, int rows, float* res, int rows_ahead) {
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
      const int8_t* xk = x + k0 * R;  // this step's 64 columns of the R rows, 64 bytes apart
      for (int r = 0; r < R; ++r) {
        const __m512i xr = _mm512_load_si512(xk + r * 64);
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
  const RowBlocks blocks = row_blocks(xq, n, K);
  at::parallel_for(0, (O + 15) / 16, 1, [&](int64_t ob0, int64_t ob1) MOETUNE_AVX512 {
    moetune_int16::scaled_blocks(row_scale, xq.step.data(), n, O, out, ldo, accumulate, ob0, ob1,
                                 [&](int64_t o0, int rows, float* acc) MOETUNE_AVX512 {
                                   for (int64_t r0 = 0; r0 < n; r0 += 8)
                                     moetune_few_rows::with_rows<8>(n - r0, [&](auto R) MOETUNE_AVX512 {
                                       forward_rows<decltype(R)::value>(dec, blocks.block(r0),
                                                                        xq.sum.data() + r0, K, o0, rows,
                                                                        acc + r0 * 16, static_cast<int>(O - o0));
                                     });
                                 });
  });
}

// Four rows of 64 bytes (w[0 .. 4)) as four vectors of quads: lane 4 L + i of v[j] holds (w[0][c], .., w[3][c]) for
// c = 16 L + 4 j + i (two rounds of unpacks within each 128-bit lane; unquad puts them, or their sums, in column
// order). quads: rows o .. o + 4 of the int8 codes plus 128 (zero rows past O), columns [k0, k0 + 64).
MOETUNE_AVX512 MOETUNE_ALWAYS_INLINE void interleave4(const __m512i w[4], __m512i v[4]) {
  const __m512i t0 = _mm512_unpacklo_epi8(w[0], w[1]), t1 = _mm512_unpackhi_epi8(w[0], w[1]);
  const __m512i t2 = _mm512_unpacklo_epi8(w[2], w[3]), t3 = _mm512_unpackhi_epi8(w[2], w[3]);
  v[0] = _mm512_unpacklo_epi16(t0, t2);
  v[1] = _mm512_unpackhi_epi16(t0, t2);
  v[2] = _mm512_unpacklo_epi16(t1, t3);
  v[3] = _mm512_unpackhi_epi16(t1, t3);
}
MOETUNE_AVX512 MOETUNE_ALWAYS_INLINE void quads(const moetune::Int8Rows& dec, int64_t O, int64_t o, int64_t k0,
                                                int64_t valid, __m512i v[4]) {
  __m512i w[4];
  for (int i = 0; i < 4; ++i)
    w[i] = o + i < O ? biased64(dec.codes + (o + i) * dec.K + k0, valid) : _mm512_setzero_si512();
  interleave4(w, v);
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

// acc rows r < R, 64 columns (four vectors of 16 in the quads' order, int32, ldacc apart) += sum_q (g_j[r, 4 q ..
// 4 q + 4) . w[4 q + j]), q < nq, w a band's staged quads: gl[j] the rows of g's integers for w[.. + j]'s columns
// (from the band's first row; int4: their group's), ldg apart; kOne: the same rows for all four (one broadcast per
// row and quad: int8, and int4 chunks inside one group)
template <int R, bool kOne>
MOETUNE_AVX512 inline void band_rows(const __m512i* w, int nq, const int8_t* const gl[4], int64_t ldg,
                                          int32_t* acc, int64_t ldacc) {
  __m512i s[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) s[r][j] = _mm512_setzero_si512();
  for (int q = 0; q < nq; ++q) {
    for (int r = 0; r < R; ++r) {
      __m512i b[4];
      for (int j = 0; j < (kOne ? 1 : 4); ++j) {
        int32_t quad;
        std::memcpy(&quad, gl[j] + r * ldg + 4 * q, 4);
        b[j] = _mm512_set1_epi32(quad);
      }
      for (int j = 0; j < 4; ++j) s[r][j] = dpbusd(s[r][j], _mm512_load_si512(w + 4 * q + j), b[kOne ? 0 : j]);
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
          const int64_t o = ob + 4 * q;  // these rows' next 64 columns (the band's next chunk), or the next band's
          const bool last = c + 1 == c1;
          for (int64_t i = last ? o + 4 * kBandQuads : o; i < std::min((last ? o + 4 * kBandQuads : o) + 4, O); ++i)
            _mm_prefetch(reinterpret_cast<const char*>(dec.codes + i * K + (last ? c0 * 64 : k0 + 64)), _MM_HINT_T2);
          quads(dec, O, o, k0, K - k0, staged + 4 * q);
        }
        for (int64_t r0 = 0; r0 < n; r0 += 4) {
          const int8_t* gr = gq.row(r0) + ob;
          const int8_t* const gl[4] = {gr, gr, gr, gr};
          moetune_few_rows::with_rows<4>(n - r0, [&](auto R) MOETUNE_AVX512 {
            band_rows<decltype(R)::value, true>(staged, nq, gl, gq.ld, acc + r0 * width + k0, width);
          });
        }
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

// ---- int4 weights (decoders.h's Int4Rows: W[o, k] = s[o, g] (u[o, k] - z[o, g]), g = k / group) ----
//
//   forward : out[r, o] (+)= step_r sum_g s[o, g] (sum_{k in g} q[r, k] u[o, k] - z[o, g] sum_{k in g} q[r, k]);
//             weight rows on the lanes (a group's scale multiplies 16 rows' int32 sums at once, where lanes along k
//             would need one multiply per row, row of x and group): each 16 weight rows' codes first transposed into
//             64-byte vectors of [16 rows][4 columns] (int4_columns), then per row of x one vpdpbusd per 4 columns
//             against its 4 bytes broadcast, the group's int32 sums (at most 127 * 15 * 128 a lane) times the scales
//             and less z s times the group's sum of q, in fp32, once per group and 16 rows (block_scales).

// Within each 128-bit lane L, the 4 x 4 transpose of 32-bit words: w[m] lane 4 L + q <- y[q] lane 4 L + m
MOETUNE_AVX512 MOETUNE_ALWAYS_INLINE void transpose4(const __m512i y[4], __m512i w[4]) {
  const __m512i t0 = _mm512_unpacklo_epi32(y[0], y[1]), t1 = _mm512_unpackhi_epi32(y[0], y[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(y[2], y[3]), t3 = _mm512_unpackhi_epi32(y[2], y[3]);
  w[0] = _mm512_unpacklo_epi64(t0, t2);
  w[1] = _mm512_unpackhi_epi64(t0, t2);
  w[2] = _mm512_unpacklo_epi64(t1, t3);
  w[3] = _mm512_unpackhi_epi64(t1, t3);
}

// Weight rows o0 .. o0 + 16 of the codes (zeros from `rows` on; `ahead` rows from o0 + kAheadBlock prefetched along
// the same bytes, four a step) as 64-byte vectors of 16 rows x 4 columns of unsigned codes, in column order: buf[k /
// 4] for k < K, lane 4 L + q holding row 4 q + L (row_of_lane). Per 16 packed bytes of four rows: one load and three
// broadcasts into the other 128-bit lanes, then a 4 x 4 transpose of 32-bit words within the lanes, then each byte's
// two nibbles: the low one column j, the high one column j + K/2. (transpose16 on the rows' words, rows in order,
// measured level at 8 rows of x and 0.74-0.76x at 1-4: docs/performance.md, "int8 activations".)
constexpr int kAheadBlock = 16;  // int4_columns prefetches the rows this far below its block's first
template <bool kWhole>  // rows == 16
MOETUNE_AVX512 inline void int4_columns(const moetune::Int4Rows& dec, int64_t o0, int rows, int ahead, __m512i* buf) {
  const int64_t half = dec.half;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int64_t j0 = 0; j0 < half; j0 += 16) {  // K / 2 is a multiple of 16
    // the next block's rows (`ahead` of them), this line, into L2: four rows a step, over the line's four steps
    for (int i = static_cast<int>(j0 / 16 % 4) * 4; i < std::min<int64_t>(ahead, j0 / 16 % 4 * 4 + 4); ++i)
      _mm_prefetch(reinterpret_cast<const char*>(dec.packed + (o0 + kAheadBlock + i) * half + j0 / 64 * 64),
                   _MM_HINT_T2);
    __m512i y[4];  // y[q] lane L: bytes j0 .. j0 + 16 of row 4 q + L
    for (int q = 0; q < 4; ++q) {
      y[q] = _mm512_setzero_si512();
      for (int L = 0; L < 4 && (kWhole || 4 * q + L < rows); ++L)
        y[q] = _mm512_mask_broadcast_i32x4(
            y[q], static_cast<__mmask16>(0xF << (4 * L)),
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(dec.packed + (o0 + 4 * q + L) * half + j0)));
    }
    __m512i w[4];
    transpose4(y, w);
    for (int m = 0; m < 4; ++m) {  // w[m] lane 4 L + q: word m of y[q]'s lane L
      buf[j0 / 4 + m] = _mm512_and_si512(w[m], low4);
      buf[(half + j0) / 4 + m] = _mm512_and_si512(_mm512_srli_epi16(w[m], 4), low4);
    }
  }
}

// the weight row int4_columns puts in lane j (4 L + q -> 4 q + L: its own inverse)
MOETUNE_AVX512 inline __m512i row_of_lane() {
  return _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
}

// the 16 x 16 transpose of 32-bit words: r[m] <- word m of each of r[0 .. 16) (lane i: r[i]'s word m)
MOETUNE_AVX512 MOETUNE_ALWAYS_INLINE void transpose16(__m512i r[16]) {
  __m512i u[16];
  for (int a = 0; a < 16; a += 4) transpose4(r + a, u + a);  // u[a + j] lane block L: word 4 L + j of rows a .. a + 4
  for (int j = 0; j < 4; ++j) {  // word 4 L + j: lane block L of u[j], u[4 + j], u[8 + j], u[12 + j]
    __m512i v[4] = {u[j], u[4 + j], u[8 + j], u[12 + j]};
    unquad(v);
    for (int L = 0; L < 4; ++L) r[4 * L + j] = v[L];
  }
}

// The block's scales and scales times zero points per group, lane j for row o0 + row_of_lane(j) (0 from `rows`
// on): s[16 g + j], sz[16 g + j] (fp32). The rows' scales (and zero points) by 16 x 16 transposes of 32-bit words,
// two bf16 scales (four zero points) a word (gathers, one per group and block, measured ~12% of the forward at one
// row of x)
MOETUNE_AVX512 inline void block_scales(const moetune::Int4Rows& dec, int64_t o0, int rows, float* s, float* sz) {
  alignas(64) int32_t lane_row[16];
  _mm512_store_si512(lane_row, row_of_lane());
  const int64_t groups = dec.groups;
  __m512i r[16];
  for (int64_t g0 = 0; g0 < groups; g0 += 32) {  // 32 bf16 scales of each row a pass
    const int64_t cnt = std::min<int64_t>(32, groups - g0);
    for (int i = 0; i < 16; ++i)
      r[i] = lane_row[i] < rows ? _mm512_maskz_loadu_epi16(moetune::first32(cnt),
                                                           dec.scale + (o0 + lane_row[i]) * groups + g0)
                                : _mm512_setzero_si512();
    transpose16(r);
    for (int64_t m = 0; 2 * m < cnt; ++m) {
      _mm512_store_ps(s + 16 * (g0 + 2 * m), _mm512_castsi512_ps(_mm512_slli_epi32(r[m], 16)));
      if (2 * m + 1 < cnt)
        _mm512_store_ps(s + 16 * (g0 + 2 * m + 1),
                        _mm512_castsi512_ps(_mm512_and_si512(r[m], _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)))));
    }
  }
  if (!dec.zero) {
    for (int64_t g = 0; g < groups; ++g)
      _mm512_store_ps(sz + 16 * g, _mm512_mul_ps(_mm512_load_ps(s + 16 * g), _mm512_set1_ps(8.0f)));
    return;
  }
  for (int64_t g0 = 0; g0 < groups; g0 += 64) {  // 64 zero points of each row a pass
    const int64_t cnt = std::min<int64_t>(64, groups - g0);
    for (int i = 0; i < 16; ++i)
      r[i] = lane_row[i] < rows ? _mm512_maskz_loadu_epi8(first64(cnt), dec.zero + (o0 + lane_row[i]) * groups + g0)
                                : _mm512_setzero_si512();
    transpose16(r);
    for (int64_t g = g0; g < g0 + cnt; ++g) {
      const int b = static_cast<int>(g - g0);
      const __m512i z = _mm512_and_si512(_mm512_srli_epi32(r[b / 4], 8 * (b % 4)), _mm512_set1_epi32(0xFF));
      _mm512_store_ps(sz + 16 * g, _mm512_mul_ps(_mm512_load_ps(s + 16 * g), _mm512_cvtepi32_ps(z)));
    }
  }
}

// res[r * 16 + i] = sum_g (s[g][i] P[r, i, g] - sz[g][i] sx[r, g]) for r < R, P the group's int32 sum of q[r, k]
// u[o0 + i, k] from int4_columns' buf; x's rows ldx apart, sx[r * groups + g] their group sums; steps: group / 4
template <int R>
MOETUNE_AVX512 void int4_rows(const __m512i* buf, const int8_t* x, int64_t ldx, const int32_t* sx, int64_t groups,
                              int64_t steps, const float* s, const float* sz, float* res) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  constexpr int C = R >= 4 ? 1 : R >= 2 ? 2 : 4;  // chains of sums per row: vpdpbusd's latency hidden at 1-3 rows
  for (int64_t g = 0; g < groups; ++g) {
    __m512i sum[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) sum[r][c] = _mm512_setzero_si512();
    for (int64_t kk = g * steps; kk < (g + 1) * steps; kk += C)  // steps (8, 16 or 32) is a multiple of C
      for (int c = 0; c < C; ++c) {
        const __m512i v = _mm512_load_si512(buf + kk + c);
        for (int r = 0; r < R; ++r) {
          int32_t quad;
          std::memcpy(&quad, x + r * ldx + 4 * (kk + c), 4);
          sum[r][c] = dpbusd(sum[r][c], v, _mm512_set1_epi32(quad));
        }
      }
    const __m512 sg = _mm512_load_ps(s + 16 * g), szg = _mm512_load_ps(sz + 16 * g);
    for (int r = 0; r < R; ++r) {
      for (int c = 1; c < C; ++c) sum[r][0] = _mm512_add_epi32(sum[r][0], sum[r][c]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r][0]), sg, acc[r]);
      acc[r] = _mm512_fnmadd_ps(szg, _mm512_set1_ps(static_cast<float>(sx[r * groups + g])), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_store_ps(res + r * 16, acc[r]);
}

// out[n, O] (+)= x[n, K] @ W^T for int4 W, the forward above
MOETUNE_AVX512 inline void int4_forward(const moetune::Int4Rows& dec, const at::BFloat16* x, int64_t ldx, int64_t n,
                                        int64_t K, int64_t O, at::BFloat16* out, int64_t ldo, bool accumulate) {
  const Int8Acts xq = moetune_int16::int_rows<int8_t>(x, ldx, n, K, nullptr, 127);
  const int64_t groups = dec.groups, group = int64_t{1} << dec.shift;
  std::vector<int32_t> sx(n * groups);  // each row's sums of q per group (rows over the threads, as int_rows')
  at::parallel_for(0, n, std::max<int64_t>(1, moetune_int16::kRowsGrainValues / K), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t g = 0; g < groups; ++g) {
        int32_t t = 0;
        for (int64_t k = g * group; k < (g + 1) * group; ++k) t += xq.row(r)[k];
        sx[r * groups + g] = t;
      }
  });
  at::parallel_for(0, (O + 15) / 16, 1, [&](int64_t ob0, int64_t ob1) MOETUNE_AVX512 {
    // the codes' K / 4 vectors; s and s z per group, [groups, 16] each; the [n, 16] sums (64-byte aligned)
    std::vector<float> space(16 * (K / 4 + 2 * groups + std::max<int64_t>(n, 8) + 1));
    float* s = space.data() + (16 - reinterpret_cast<uintptr_t>(space.data()) / 4 % 16) % 16;
    float* sz = s + 16 * groups;
    float* res = sz + 16 * groups;
    auto* buf = reinterpret_cast<__m512i*>(res + 16 * std::max<int64_t>(n, 8));
    for (int64_t ob = ob0; ob < ob1; ++ob) {
      const int64_t o0 = ob * 16;
      const int rows = static_cast<int>(std::min<int64_t>(16, O - o0));
      const __m512i lanes = row_of_lane();
      block_scales(dec, o0, rows, s, sz);
      const int ahead = static_cast<int>(std::clamp<int64_t>(O - o0 - kAheadBlock, 0, 16));
      if (rows == 16)
        int4_columns<true>(dec, o0, rows, ahead, buf);
      else
        int4_columns<false>(dec, o0, rows, ahead, buf);
      for (int64_t r0 = 0; r0 < n; r0 += 8)
        moetune_few_rows::with_rows<8>(n - r0, [&](auto R) MOETUNE_AVX512 {
          int4_rows<decltype(R)::value>(buf, xq.row(r0), xq.ld, sx.data() + r0 * groups, groups, group / 4,
                                        s, sz, res + r0 * 16);
        });
      for (int64_t r = 0; r < n; ++r) {  // back to row order
        const __m512 v = _mm512_permutexvar_ps(lanes, _mm512_load_ps(res + r * 16));
        moetune::store_row(out + r * ldo + o0, _mm512_mul_ps(v, _mm512_set1_ps(xq.step[r])), first(rows), accumulate);
      }
    }
  });
}

//   backward: out[r, k] (+)= sum_o g[r, o] W[o, k] = step_rg (sum_o q_g[r, o] u[o, k] - sum_o q_g[r, o] z[o, g]) for
//             k in group g, where q_g, step_rg are row r of g times the group's scales s[., g] as 8-bit integer rows
//             (each group's own: the scales into g, as few_rows.h's RawPairs32 takes them in bf16); lanes along k
//             in column order, four weight rows' codes per lane (int4_quads), bands of 32 quads staged once for all
//             rows of g, q_g's four values broadcast per 16 columns (one group), the int32 sums (at most 15 * 127 O
//             a lane) kept per packed chunk and converted once it has seen every band.

// Weight rows o .. o + 4 of the packed codes (zero rows past O), packed bytes [j0, j0 + 64) (zeros past valid):
// lo[j] the low nibbles (columns j0 ..), hi[j] the high ones (columns K/2 + j0 ..), four codes a lane: in column
// order (kOrdered: lane i of lo[L] holds (u[o, c], .., u[o + 3, c]) for c = j0 + 16 L + i) or in interleave4's
// (lane 4 L + i of lo[j]: c = j0 + 16 L + 4 j + i; one unquad fewer per quad, for chunks inside one group)
template <bool kOrdered>
MOETUNE_AVX512 MOETUNE_ALWAYS_INLINE void int4_quads(const moetune::Int4Rows& dec, int64_t O, int64_t o, int64_t j0,
                                                     int64_t valid, __m512i lo[4], __m512i hi[4]) {
  __m512i w[4], v[4];
  for (int i = 0; i < 4; ++i)
    w[i] = o + i < O ? _mm512_maskz_loadu_epi8(first64(valid), dec.packed + (o + i) * dec.half + j0)
                     : _mm512_setzero_si512();
  interleave4(w, v);
  if constexpr (kOrdered) unquad(v);
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int j = 0; j < 4; ++j) {
    lo[j] = _mm512_and_si512(v[j], low4);
    hi[j] = _mm512_and_si512(_mm512_srli_epi16(v[j], 4), low4);
  }
}

// Row r of g times group gi's scales as 8-bit rows (q, step, sum: int_rows) and its z term sum_o q[r, o] z[o, gi]
struct GroupRows {
  int64_t gi = -1;
  Int8Acts q;
  std::vector<int32_t> zterm;  // [n]
};

// GroupRows for group gi: gf g's rows in fp32 ([n, O]); st, zt scratch of O values
MOETUNE_AVX512 inline void group_rows(const moetune::Int4Rows& dec, int64_t gi, const float* gf, int64_t n, int64_t O,
                                      float* st, int32_t* zt, GroupRows& out) {
  const __m512i step = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(static_cast<int>(dec.groups)));
  for (int64_t o = 0; o < O; o += 16) {  // the group's scales (and zero points) along O, gathered
    const __mmask16 m = first(static_cast<int>(O - o));
    const __m512i idx = _mm512_add_epi32(step, _mm512_set1_epi32(static_cast<int>(gi)));
    const __m512i s16 = moetune::gather_u16(dec.scale + o * dec.groups, idx, m);
    _mm512_mask_storeu_ps(st + o, m, _mm512_castsi512_ps(_mm512_slli_epi32(s16, 16)));
    if (dec.zero) _mm512_mask_storeu_epi32(zt + o, m, moetune::gather_u8(dec.zero + o * dec.groups, idx, m));
  }
  out.gi = gi;
  out.q = moetune_int16::int_rows<int8_t>(gf, O, n, O, st, 127);
  out.zterm.resize(n);
  for (int64_t r = 0; r < n; ++r) {
    if (!dec.zero) {  // z = 8
      out.zterm[r] = 8 * out.q.sum[r];
      continue;
    }
    const int8_t* q = out.q.row(r);
    __m512i t = _mm512_setzero_si512();
    for (int64_t o = 0; o < O; o += 16) {
      const __mmask16 m = first(static_cast<int>(O - o));
      const __m512i qv = _mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, q + o));
      t = _mm512_add_epi32(t, _mm512_mullo_epi32(qv, _mm512_maskz_loadu_epi32(m, zt + o)));
    }
    out.zterm[r] = _mm512_reduce_add_epi32(t);
  }
}

// out[n, K] (+)= g[n, O] @ W for int4 W, the backward above; kOne: every 64 columns of a packed chunk in one group
// (groups of 64 or more, K / 2 a multiple of 64). Each thread walks its packed chunks one at a time, all bands of
// each (the next band's rows prefetched along the chunk), with the groups of the chunk's columns quantized as it
// reaches them and kept while the next chunk uses them: memory per thread is a few groups' rows of g (n O bytes
// each) and one chunk's sums, whatever K and the group count.
template <bool kOne>
MOETUNE_AVX512 inline void int4_backward(const moetune::Int4Rows& dec, const at::BFloat16* g, int64_t ldg, int64_t n,
                                         int64_t K, int64_t O, at::BFloat16* out, int64_t ldo, bool accumulate) {
  const int64_t groups = dec.groups, half = dec.half;
  const int shift = dec.shift;
  std::vector<float> gf(n * O);  // g in fp32, widened once for all groups
  for (int64_t r = 0; r < n; ++r)
    for (int64_t o = 0; o < O; o += 16)
      _mm512_mask_storeu_ps(gf.data() + r * O + o, first(static_cast<int>(O - o)), moetune::widen16(g + r * ldg, o, O));
  at::parallel_for(0, (half + 63) / 64, 1, [&](int64_t c0, int64_t c1) MOETUNE_AVX512 {
    std::vector<float> st(O);
    std::vector<int32_t> zt(dec.zero ? O : 0);
    std::vector<std::unique_ptr<GroupRows>> held, next;  // the groups quantized for this chunk (and the last)
    const int64_t width = 128 + 16;  // a row's sums: the chunk's low columns, then its high ones; a line more
    std::vector<int32_t> accv(n * width);
    alignas(64) __m512i staged[8 * kBandQuads];  // the band's quads: low nibbles' 4 vectors, then the high ones'
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t j0 = c * 64, valid = std::min<int64_t>(64, half - j0);
      const GroupRows* gl[2][4];  // per stream and 16 columns: its group's rows
      next.clear();
      for (int h = 0; h < 2; ++h)
        for (int L = 0; L < 4; ++L) {
          const int64_t gi = std::min(groups - 1, ((h ? half + j0 : j0) + 16 * L) >> shift);
          auto find = [gi](const std::unique_ptr<GroupRows>& x) { return x && x->gi == gi; };
          auto in_next = std::find_if(next.begin(), next.end(), find);
          if (in_next == next.end()) {
            auto in_held = std::find_if(held.begin(), held.end(), find);
            if (in_held != held.end()) {
              next.push_back(std::move(*in_held));
            } else {
              next.push_back(std::make_unique<GroupRows>());
              group_rows(dec, gi, gf.data(), n, O, st.data(), zt.data(), *next.back());
            }
            in_next = next.end() - 1;
          }
          gl[h][L] = in_next->get();
        }
      std::swap(held, next);
      std::fill(accv.begin(), accv.end(), 0);
      for (int64_t ob = 0; ob < O; ob += 4 * kBandQuads) {
        const int nq = static_cast<int>(std::min<int64_t>(kBandQuads, (O - ob + 3) / 4));
        for (int q = 0; q < nq; ++q) {
          const int64_t o = ob + 4 * q, ahead = o + 4 * kBandQuads;  // the next band's rows, the same bytes
          for (int64_t i = ahead; i < std::min(ahead + 4, O); ++i)
            _mm_prefetch(reinterpret_cast<const char*>(dec.packed + i * half + j0), _MM_HINT_T2);
          int4_quads<!kOne>(dec, O, o, j0, valid, staged + 4 * q, staged + 4 * (kBandQuads + q));
        }
        for (int h = 0; h < 2; ++h) {  // the low columns, then the high ones
          const int64_t ldq = gl[h][0]->q.ld;
          for (int64_t r0 = 0; r0 < n; r0 += 6) {
            const int8_t* gr[4];
            for (int L = 0; L < 4; ++L) gr[L] = gl[h][L]->q.row(r0) + ob;
            moetune_few_rows::with_rows<6>(n - r0, [&](auto R) MOETUNE_AVX512 {
              band_rows<decltype(R)::value, kOne>(staged + 4 * kBandQuads * h, nq, gr, ldq,
                                                      accv.data() + r0 * width + 64 * h, width);
            });
          }
        }
      }
      for (int h = 0; h < 2; ++h) {
        const int64_t k0 = h ? half + j0 : j0;
        for (int64_t r = 0; r < n; ++r) {
          const int32_t* a = accv.data() + r * width + 64 * h;
          __m512i v[4];
          for (int j = 0; j < 4; ++j) v[j] = _mm512_loadu_si512(a + 16 * j);
          if constexpr (kOne) unquad(v);
          for (int L = 0; 16 * L < valid; ++L) {
            const GroupRows& gg = *gl[h][L];
            const __m512i t = _mm512_sub_epi32(v[L], _mm512_set1_epi32(gg.zterm[r]));
            moetune::store_row(out + r * ldo + k0 + 16 * L,
                               _mm512_mul_ps(_mm512_cvtepi32_ps(t), _mm512_set1_ps(gg.q.step[r])), 0xFFFF,
                               accumulate);
          }
        }
      }
    }
  });
}

MOETUNE_AVX512 inline void int4_backward(const moetune::Int4Rows& dec, const at::BFloat16* g, int64_t ldg, int64_t n,
                                         int64_t K, int64_t O, at::BFloat16* out, int64_t ldo, bool accumulate) {
  if (dec.shift >= 6 && dec.half % 64 == 0)
    int4_backward<true>(dec, g, ldg, n, K, O, out, ldo, accumulate);
  else
    int4_backward<false>(dec, g, ldg, n, K, O, out, ldo, accumulate);
}

}  // namespace moetune_int8
