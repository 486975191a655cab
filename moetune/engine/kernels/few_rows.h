// Loops for few rows of activations (the engine's small experts) on AVX512-BF16 that stream each weight row once,
// in order, so that memory, not the loops, sets the pace:
//
//   forward (dense bf16 weights): out[n, O] (+)= x[n, K] @ W^T   four weight rows at a time against blocks of up
//             to 4 rows of x, lanes along k (acc[j][r] += x[r, k..k+32) . W[o + j, k..k+32)), the 16 accumulators
//             summed across their lanes at once at the end of the rows (reduce16). The next group's rows are
//             prefetched into L2 as the current ones stream, spread over the passes of x's blocks (each pass
//             one share of the four rows: the rate the memory is asked for stays level): a row is K apart from the
//             next, too short a run for the hardware prefetcher to lock on for K = 768-2048. (Two weight rows against
//             8 rows of x read each row of x twice as often: 15-20% slower at 16-32 rows.)
//   backward (dense bf16; the AVX512 variant's decoders: group-scaled up to 8-32 rows, all where staged; int8 as
//             int16 pairs at all rows, int16_rows.h):
//             out[n, K] (+)= g[n, O] @ W
//             bands of weight row pairs (8, 16 or 32 pairs by rows of g: band_pairs) walked along k 32 columns
//             at a time, rows o and o + 1 interleaved in registers into (W[o, k], W[o + 1, k]) pairs (bf16:
//             vpunpck{l,h}wd, which leaves the columns in another order, undone once at the end; decoders:
//             DecodedPairs32 below, or RawPairs32 where a weight is group-scaled: raw values, g times the scales),
//             g's pair (g[r, o], g[r, o + 1]) broadcast; the fp32 sums of all n rows in a
//             per-call buffer, read and written once per band and 32 columns (above 8 rows, rows one cache line
//             apart from a 4 KiB multiple: 4 KiB-apart rows share one L1 set; staged decoders' pairs decoded once
//             per band and 32 columns for all blocks of 8 rows: staged_band_chunk), rounded into out once at the
//             end; the next band's rows prefetched into L2 along the same columns (bf16 also a T0 prefetch 128
//             bytes ahead in each row: both measured best, docs/performance.md).
//
// W's rows are Bf16Rows::ld apart (>= K: DenseExperts pads bf16 rows of 4 KiB multiples by one line, so that the
// backward's band does not fall in one L1 set; formats/dense.py).
//
// The run_gemm overload at the end replaces the AVX512 variant's decoding loops for moetune::Bf16Rows (entry.h's
// contract). Why (docs/performance.md, "Dense bf16 experts with few rows", "Prefetching into L2"): with few rows
// oneDNN's bf16 GEMM re-lays out the weight on every call and streams it at a fraction of the rate these loops do
// (AMD EPYC Zen 4, one thread, [1536, 2048] at n = 8: forward 0.41 vs 1.21 ms, backward 0.51 vs 1.02 ms; level at 64
// rows; `python bench/bf16_products.py`), and in the engine a run of experts is one call, unpadded.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "decoders.h"
#include "layouts.h"
#include "rows_layout.h"  // row_blocks: pair_blocks

namespace moetune_few_rows {

using moetune::first;
using moetune::first32;
using moetune::store_row;

// backward: weight row pairs per band by rows of g (the fp32 sums are read and written once per band and 32 columns,
// so wider bands cut that traffic where there are more rows to sum; with one or two rows narrow bands measured faster)
constexpr int kBandPairs = 32;
constexpr int band_pairs(int64_t n) { return n <= 2 ? 8 : n <= 4 ? 16 : kBandPairs; }
// the same for RawPairs32 (its pairs staged, the scaled g per band): 32 pairs from 3 rows (1.02-1.07x against 16 at
// 3-4 rows for int4 and fp8_block; at 1-2 rows 32 measured 0.85-1.14x against 8)
constexpr int raw_band_pairs(int64_t n) { return n <= 2 ? 8 : kBandPairs; }
// backward, bf16: bytes ahead of each weight row's current 64 that a step prefetches towards L1
constexpr int kAheadBytes = 128;

// f(std::integral_constant<int, R>{}) with R = min(rows, MAX), rows >= 1: a register block's rows as a template
// argument (its accumulator arrays then live in registers), chosen at run time
template <int MAX, int R = 1, class F>
MOETUNE_AVX512 inline void with_rows(int64_t rows, F&& f) {
  if constexpr (R == MAX) {
    f(std::integral_constant<int, MAX>{});
  } else if (rows <= R) {
    f(std::integral_constant<int, R>{});
  } else {
    with_rows<MAX, R + 1>(rows, std::forward<F>(f));
  }
}

// 16 vectors -> one, lane i the sum of v[i]'s 16 lanes (45 instructions, against 16 x ~8 for one reduce each)
MOETUNE_AVX512 inline __m512 reduce16(const __m512 v[16]) {
  __m512 u[8], s[4], t[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: (a0 + a2, b0 + b2, a1 + a3, b1 + b3)
    u[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: one partial sum of each of 4 sources
    const __m512d a = _mm512_castps_pd(u[2 * i]), b = _mm512_castps_pd(u[2 * i + 1]);
    s[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i)  // 128-bit lanes pairwise: (s0 lanes 0 + 1, s0 2 + 3, s1 0 + 1, s1 2 + 3)
    t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(t[0], t[1], 0x88), _mm512_shuffle_f32x4(t[0], t[1], 0xDD));
}

// res[r * 16 + j] = the sum of acc0[r]'s lanes and res[r * 16 + j + 1] that of acc1[r]'s (where two) for r < R: two
// weight rows' dot products with R rows of x (from 4 rows the 2 R sums at once: reduce16, 45 instructions against ~8
// per sum)
template <int R>
MOETUNE_AVX512 inline void pair_sums(const __m512 acc0[R], const __m512 acc1[R], bool two, float* res, int j) {
  if constexpr (R >= 4) {
    __m512 v[16];
    for (int r = 0; r < 8; ++r) {
      v[r] = r < R ? acc0[r] : _mm512_setzero_ps();
      v[8 + r] = r < R ? acc1[r] : _mm512_setzero_ps();
    }
    alignas(64) float sums[16];
    _mm512_store_ps(sums, reduce16(v));
    for (int r = 0; r < R; ++r) {
      res[r * 16 + j] = sums[r];
      if (two) res[r * 16 + j + 1] = sums[8 + r];
    }
  } else {
    for (int r = 0; r < R; ++r) {
      res[r * 16 + j] = _mm512_reduce_add_ps(acc0[r]);
      if (two) res[r * 16 + j + 1] = _mm512_reduce_add_ps(acc1[r]);
    }
  }
}

// sums[j * 4 + r] = x[r] . W[o + j] over K columns, for j < 4 weight rows (w[j]; a repeated pointer past a block's
// end) and r < R <= 4 rows of x (the others zero; 64-byte aligned), x's rows ldx apart (masked tail: no read past a
// row); next: the group computed next, rows [j0, j1) of whose four (K apart) are prefetched into L2 along the same
// columns (a prefetch never faults: past W's end it does nothing)
template <int R>
MOETUNE_AVX512 inline void forward_group(const uint16_t* const w[4], const uint16_t* x, int64_t ldx, int64_t K,
                                         int64_t ldw, const uint16_t* next, int j0, int j1, float* sums) {
  __m512 acc[16];  // local, so that they live in registers (through a caller's array they went through memory)
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  auto step = [&](int64_t k0, __mmask32 m, bool whole) MOETUNE_AVX512 {
    __m512bh v[R];
    for (int r = 0; r < R; ++r) {
      const uint16_t* xr = x + r * ldx + k0;
      v[r] = (__m512bh)(whole ? _mm512_loadu_si512(xr) : _mm512_maskz_loadu_epi16(m, xr));
    }
    for (int j = 0; j < 4; ++j) {
      const __m512bh a = (__m512bh)(whole ? _mm512_loadu_si512(w[j] + k0) : _mm512_maskz_loadu_epi16(m, w[j] + k0));
      for (int r = 0; r < R; ++r) acc[j * 4 + r] = _mm512_dpbf16_ps(acc[j * 4 + r], v[r], a);
    }
  };
  int64_t k0 = 0;
  for (; k0 + 32 <= K; k0 += 32) {
    for (int j = j0; j < j1; ++j) _mm_prefetch(reinterpret_cast<const char*>(next + j * ldw + k0), _MM_HINT_T2);
    step(k0, ~(__mmask32)0, true);
  }
  if (k0 < K) step(k0, first32(K - k0), false);
  _mm512_store_ps(sums, reduce16(acc));
}

// forward for output columns (weight rows) [16 ob0, 16 ob1): each 16-row block's [n, 16] fp32 sums, then rounded.
MOETUNE_AVX512 inline void forward_range(const uint16_t* w, int64_t ldw, const uint16_t* x, int64_t ldx, int64_t n,
                                         int64_t K, int64_t O, at::BFloat16* out, int64_t ldo, bool accumulate,
                                         int64_t ob0, int64_t ob1) {
  std::vector<float> res(n * 16);
  const int64_t blocks = (n + 3) / 4;  // of x's rows: pass b prefetches the next group's rows [4b / blocks, ...)
  for (int64_t ob = ob0; ob < ob1; ++ob) {
    const int64_t o0 = ob * 16;
    const int rows = static_cast<int>(std::min<int64_t>(16, O - o0));
    for (int j0 = 0; j0 < rows; j0 += 4) {
      const uint16_t* wr[4];
      for (int j = 0; j < 4; ++j) wr[j] = w + (o0 + std::min(j0 + j, rows - 1)) * ldw;
      for (int64_t r0 = 0; r0 < n; r0 += 4) {  // a second block of x finds the group's rows in L1
        alignas(64) float sums[16];
        const int64_t b = r0 / 4;
        with_rows<4>(n - r0, [&](auto R) MOETUNE_AVX512 {  // the next group: the next four rows
          forward_group<decltype(R)::value>(wr, x + r0 * ldx, ldx, K, ldw, wr[0] + 4 * ldw,
                                            static_cast<int>(4 * b / blocks), static_cast<int>(4 * (b + 1) / blocks),
                                            sums);
        });
        for (int64_t r = 0; r < std::min<int64_t>(4, n - r0); ++r)
          for (int j = 0; j < 4 && j0 + j < rows; ++j) res[(r0 + r) * 16 + j0 + j] = sums[j * 4 + r];
      }
    }
    for (int64_t r = 0; r < n; ++r)
      store_row(out + r * ldo + o0, _mm512_loadu_ps(res.data() + r * 16), first(rows), accumulate);
  }
}

// Rows o and o + 1 of W stored in bf16, columns [k0, k0 + 32), as two pair vectors (vpunpck{l,h}wd within each
// 128-bit lane: lo holds columns 0-3, 8-11, 16-19, 24-27 of the 32, hi 4-7, 12-15, 20-23, 28-31; kPermuted); a zero
// row past O
struct Bf16Pairs {
  static constexpr bool kPermuted = true;
  static constexpr bool kStaged = false;  // loaded as stored: nothing to decode ahead
  const uint16_t* w;
  int64_t ldw, O;        // rows ldw apart (DenseExperts' padded rows)
  const uint16_t* zero;  // K + 32 zeros
  MOETUNE_AVX512 inline void operator()(int64_t o, int64_t k0, int64_t valid, __m512bh& lo, __m512bh& hi) const {
    const uint16_t* a = (o < O ? w + o * ldw : zero) + k0;
    const uint16_t* b = (o + 1 < O ? w + (o + 1) * ldw : zero) + k0;
    __m512i va, vb;
    if (valid >= 32) {
      _mm_prefetch(reinterpret_cast<const char*>(a) + kAheadBytes, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(b) + kAheadBytes, _MM_HINT_T0);
      va = _mm512_loadu_si512(a);
      vb = _mm512_loadu_si512(b);
    } else {
      va = _mm512_maskz_loadu_epi16(first32(valid), a);
      vb = _mm512_maskz_loadu_epi16(first32(valid), b);
    }
    lo = (__m512bh)_mm512_unpacklo_epi16(va, vb);
    hi = (__m512bh)_mm512_unpackhi_epi16(va, vb);
  }
  inline const void* code(int64_t o, int64_t k) const { return w + o * ldw + k; }  // for prefetch_pair
};

// The same from a quantized format's decoder (decoders.h) with a table (bf16x32: int4, mxfp4, fp8_block), past the
// rows of g that RawPairs32 below takes: each row's 32 values at once, interleaved as Bf16Pairs' (kPermuted), the
// band's pairs decoded before its dot products (kStaged: 1.05-1.4x at n = 1-8; decoded between them 0.7x). (int8
// takes int16_rows.h's Int16Pairs.) fp8_block's table here at 1-8 rows measured 0.78-0.94x against RawPairs32 (its
// four table vectors per row and 32 columns are loads where the 16-column decoder computes), past 32 rows 1.04-1.14x
// against the strips it replaced (avx512_gemm.cpp). Its 16-column decodes in column order here (layouts.h's
// decode_pair) were last taken by int8 at 6-8 rows, where RawPairs32 unstaged measured 1.11-1.14x.
// Dropped: a prefetch 64 columns ahead in each row as well (int4's backward 1.4-1.6x slower at n = 8, int8's up to
// 1.1x faster).
template <class Dec>
struct DecodedPairs32 {
  static_assert(moetune::has_table<Dec>::value, "DecodedPairs32: decoders with a table (bf16x32)");
  static constexpr bool kPermuted = true;
  static constexpr bool kStaged = true;
  const Dec& dec;
  int64_t O;
  MOETUNE_AVX512 inline void operator()(int64_t o, int64_t k0, int64_t valid, __m512bh& lo, __m512bh& hi) const {
    const __m512i a = o < O ? moetune::bf16_chunk(dec, o, k0, valid) : _mm512_setzero_si512();
    const __m512i b = o + 1 < O ? moetune::bf16_chunk(dec, o + 1, k0, valid) : _mm512_setzero_si512();
    lo = (__m512bh)_mm512_unpacklo_epi16(a, b);
    hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
  }
  inline const void* code(int64_t o, int64_t k) const { return dec.code(o, k); }  // for prefetch_pair
};

// The same from a group-scaled decoder (decoders.h's raw_rows / scales16: W[o, k] = S(o, k) * V[o, k], V exact in
// bf16, S one fp32 scale per row and aligned 32 or more columns), its scales taken into g instead (scale_band
// below): g[r, o] * S(o, k) rounded once to bf16, times V. A row's V decodes with a constant table (int4 symmetric,
// mxfp4; with zero points one of 16 made once per process) or none (fp8_block), where the weights' own bf16
// values need a table or a multiply per row and 32 columns; the scaled g costs a multiply per row of g, row of W and
// column group instead, so this form pays with few rows of g (use_raw_pairs). Rows of W from one base pointer, one
// stride apart (raw_rows), not through a per-row index: the decoding loop keeps its pointers in registers. Staged
// (a band's pairs decoded before its dot products) or, with 6-8 rows of g, decoded between them (raw_staged).
template <class Dec, bool Staged = true>
struct RawPairs32 {
  static constexpr bool kPermuted = true;
  static constexpr bool kStaged = Staged;
  const Dec& dec;
  int64_t O;
  inline const void* code(int64_t o, int64_t k) const { return dec.code(o, k); }  // for prefetch_pair
  // rows o and o + 1 (zero past O) as (W[o, k], W[o + 1, k]) pairs, Bf16Pairs' interleave (unstaged)
  MOETUNE_AVX512 MOETUNE_ALWAYS_INLINE void operator()(int64_t o, int64_t k0, int64_t valid, __m512bh& lo,
                                                      __m512bh& hi) const {
    dec.raw_rows(o, k0, valid, [&](auto row, auto) MOETUNE_AVX512 {
      const __m512i a = row(0);
      const __m512i b = o + 1 < O ? row(1) : _mm512_setzero_si512();
      lo = (__m512bh)_mm512_unpacklo_epi16(a, b);
      hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
    });
  }
  // the band's np pairs from o0 into staged (the rows `ahead` below each pair prefetched along the same columns)
  MOETUNE_AVX512 inline void stage(int64_t o0, int np, int64_t k0, int64_t valid, int64_t ahead,
                                   __m512bh* staged) const {
    const int64_t left = O - o0;  // rows of W from o0
    dec.raw_rows(o0, k0, valid, [&](auto row, auto addr) MOETUNE_AVX512 {
      for (int p = 0; p < np; ++p) {
        if (ahead) {  // (a prefetch past W's end does nothing)
          _mm_prefetch(static_cast<const char*>(addr(2 * p + ahead)), _MM_HINT_T2);
          _mm_prefetch(static_cast<const char*>(addr(2 * p + 1 + ahead)), _MM_HINT_T2);
        }
        const __m512i a = 2 * p < left ? row(2 * p) : _mm512_setzero_si512();
        const __m512i b = 2 * p + 1 < left ? row(2 * p + 1) : _mm512_setzero_si512();
        staged[2 * p] = (__m512bh)_mm512_unpacklo_epi16(a, b);
        staged[2 * p + 1] = (__m512bh)_mm512_unpackhi_epi16(a, b);
      }
    });
  }
};

// whether a Pairs is RawPairs32 (its own staging, g times the scales)
template <class Pairs>
struct is_raw_pairs : std::false_type {};
template <class Dec, bool Staged>
struct is_raw_pairs<RawPairs32<Dec, Staged>> : std::true_type {};

template <class Dec, class = void>
struct has_raw : std::false_type {};
template <class Dec>
struct has_raw<Dec, std::void_t<decltype(std::declval<const Dec&>().scales16(0, 0, 0))>> : std::true_type {};

// Whether the backward with n rows of g takes RawPairs32: up to the decoder's raw_rows, 8 per 32 columns a scale
// covers, at most 32 (mxfp4: 8, fp8_block: 32; int4 by group and zero points, decoders.h). The scaled g's cost grows
// with the rows of g and falls with the columns per scale; the decoding it saves does not grow with rows (staged per
// band): against the weights' bf16 values (AMD EPYC Zen 4, one thread, [1536, 2048] and [2048, 768]) 1.03-1.8x up
// to these rows, 0.8-0.96x at twice them for g32 with zero points and mxfp4 (docs/performance.md, "Scales into g").
template <class Dec>
inline bool use_raw_pairs(const Dec& dec, int64_t n) {
  if constexpr (has_raw<Dec>::value) return dec.raw_ok(n) && n <= dec.raw_rows();
  return false;
}
// Whether RawPairs32 with n rows of g stages a band's pairs: not at 6-8 rows for decoders with kRawUnstaged, where
// 12-16 dot products per pair hide the decoding between them and staging adds its stores and loads (fp8_block
// 1.04-1.10x, mxfp4 1.14-1.27x, int8 1.11-1.14x unstaged at 6-8 rows; 0.8-0.95x at 1-4 and 0.87x at 12-16, AMD EPYC
// Zen 4, [1536, 2048] and [2048, 768]: docs/performance.md, "fp8_block: the codes' values by integer operations")
template <class Dec>
constexpr bool raw_staged(int64_t n) {
  return !Dec::kRawUnstaged || n < 6 || n > 8;
}

// gs[r * 2 np + i] = g[r, o0 + i] * S(o0 + i, k0), rounded once to bf16, for r < n, i < 2 np (rows past O: 0);
// g's columns o0 .. o0 + 2 np lie inside its (even) width
template <class Dec>
MOETUNE_AVX512 inline void scale_band(const Dec& dec, const uint16_t* g, int64_t ldg, int64_t n, int64_t o0, int np,
                                      int64_t k0, int64_t O, uint16_t* gs) {
  for (int i = 0; i < 2 * np; i += 16) {
    const bool whole = 2 * np - i >= 16;  // masked stores only at a band's odd end (they measured slow)
    const __mmask16 m = first(2 * np - i);
    const __m512 sv = dec.scales16(o0 + i, k0, m & first(static_cast<int>(std::min<int64_t>(16, O - o0 - i))));
    for (int64_t r = 0; r < n; ++r) {
      const uint16_t* gr = g + r * ldg + o0 + i;
      const __m256i v =
          whole ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(gr)) : _mm256_maskz_loadu_epi16(m, gr);
      const __m512 prod = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16)), sv);
      const __m256i b = (__m256i)_mm512_cvtneps_pbh(prod);
      if (whole)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(gs + r * 2 * np + i), b);
      else
        _mm256_mask_storeu_epi16(gs + r * 2 * np + i, m, b);
    }
  }
}

// rows o and o + 1 of a Pairs' weight (those before its O), the line holding column k0, into L2
template <class Pairs>
MOETUNE_ALWAYS_INLINE void prefetch_pair(const Pairs& pairs, int64_t o, int64_t k0) {
  for (int64_t r = o; r < std::min(o + 2, pairs.O); ++r) moetune::prefetch<_MM_HINT_T2>(pairs, r, k0);
}

// a band's np pairs from o0 decoded into staged (the rows `ahead` below each pair prefetched along the same columns)
template <class Pairs>
MOETUNE_AVX512 MOETUNE_ALWAYS_INLINE void stage_band(const Pairs& pairs, int64_t o0, int np, int64_t k0,
                                                     int64_t valid, int64_t ahead, __m512bh* staged) {
  if constexpr (is_raw_pairs<Pairs>::value) {
    pairs.stage(o0, np, k0, valid, ahead, staged);
  } else {
    for (int p = 0; p < np; ++p) {
      if (ahead) prefetch_pair(pairs, o0 + 2 * p + ahead, k0);
      pairs(o0 + 2 * p, k0, valid, staged[2 * p], staged[2 * p + 1]);
    }
  }
}

// acc + a . b (vpdpwssd: per 32-bit lane, the two int16 products summed into acc). Through asm: for the intrinsic
// GCC 12 copied every accumulator to another register and back around each instruction, and spilled one to the stack
// at 8 rows of x (the forward at n = 8 0.8x of 7 rows' speed)
MOETUNE_ALWAYS_INLINE __m512i dpwssd(__m512i acc, __m512i a, __m512i b) {
  asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}

// whether a Pairs hands out int16 pairs for int32 sums (int16_rows.h's Int16Pairs: kInt16Sums) instead of bf16 ones
template <class Pairs, class = void>
struct int16_sums : std::false_type {};
template <class Pairs>
struct int16_sums<Pairs, std::void_t<decltype(Pairs::kInt16Sums)>> : std::bool_constant<Pairs::kInt16Sums> {};

// acc rows r < R, columns [k0, k0 + 32) (lo: the first 16 lanes, hi: the next, in the pairs' column order)
// += g[r, o0 .. o0 + 2 np) @ W[o0 .. o0 + 2 np, k0 .. k0 + 32); ahead > 0: the rows that many below each pair
// prefetched along the same columns (the next band's). int16_sums Pairs: g's rows and the pairs int16, the band's
// products summed in int32 lanes (vpdpwssd) and added into acc once.
// kBlocked: g is a block of pair_blocks (pair p of row r at (p R + r) * 2; ldg unused).
template <int R, class Pairs, bool kBlocked = false>
MOETUNE_AVX512 inline void backward_chunk(const Pairs& pairs, int64_t o0, int np, int64_t k0, int64_t valid,
                                          const uint16_t* g, int64_t ldg, float* acc, int64_t ldacc, int64_t ahead) {
  constexpr bool kStage = Pairs::kStaged;
  constexpr bool kInt = int16_sums<Pairs>::value;
  using Sum = std::conditional_t<kInt, __m512i, __m512>;
  alignas(64) __m512bh staged[kStage ? 2 * kBandPairs : 1];  // the band's pairs, decoded first
  if constexpr (kStage) stage_band(pairs, o0, np, k0, valid, ahead, staged);
  Sum lo[R], hi[R];
  for (int r = 0; r < R; ++r) {
    if constexpr (kInt) {
      lo[r] = hi[r] = _mm512_setzero_si512();
    } else {
      lo[r] = _mm512_loadu_ps(acc + r * ldacc + k0);
      hi[r] = _mm512_loadu_ps(acc + r * ldacc + k0 + 16);
    }
  }
  for (int p = 0; p < np; ++p) {
    __m512bh wl, wh;
    if constexpr (kStage) {
      wl = staged[2 * p];
      wh = staged[2 * p + 1];
    } else {
      if (ahead) prefetch_pair(pairs, o0 + 2 * p + ahead, k0);
      pairs(o0 + 2 * p, k0, valid, wl, wh);
    }
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, kBlocked ? g + (p * R + r) * 2 : g + r * ldg + 2 * p, 4);
      if constexpr (kInt) {
        const __m512i gp = _mm512_set1_epi32(pair);
        lo[r] = dpwssd(lo[r], gp, (__m512i)wl);
        hi[r] = dpwssd(hi[r], gp, (__m512i)wh);
      } else {
        const __m512bh gp = (__m512bh)_mm512_set1_epi32(pair);
        lo[r] = _mm512_dpbf16_ps(lo[r], gp, wl);
        hi[r] = _mm512_dpbf16_ps(hi[r], gp, wh);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    float* a = acc + r * ldacc + k0;
    if constexpr (kInt) {
      _mm512_storeu_ps(a, _mm512_add_ps(_mm512_loadu_ps(a), _mm512_cvtepi32_ps(lo[r])));
      _mm512_storeu_ps(a + 16, _mm512_add_ps(_mm512_loadu_ps(a + 16), _mm512_cvtepi32_ps(hi[r])));
    } else {
      _mm512_storeu_ps(a, lo[r]);
      _mm512_storeu_ps(a + 16, hi[r]);
    }
  }
}

// A band's pairs already decoded (staged[2 p], staged[2 p + 1]: rows o0 + 2p and + 1), handed out as a Pairs
template <class Pairs>
struct StagedBand {
  static constexpr bool kPermuted = Pairs::kPermuted;
  static constexpr bool kStaged = false;
  const Pairs& pairs;
  const __m512bh* staged;
  int64_t o0, O;
  MOETUNE_AVX512 inline void operator()(int64_t o, int64_t, int64_t, __m512bh& lo, __m512bh& hi) const {
    lo = staged[o - o0];
    hi = staged[o - o0 + 1];
  }
  inline const void* code(int64_t o, int64_t k) const { return pairs.code(o, k); }
};

// backward_chunk for all n rows of g (blocks of 8), the band's np pairs decoded once for all of them (the rows
// `ahead` below each pair prefetched along the same columns)
template <class Pairs>
MOETUNE_AVX512 void staged_band_chunk(const Pairs& pairs, int64_t o0, int np, int64_t k0, int64_t valid,
                                      const uint16_t* g, int64_t ldg, int64_t n, float* acc, int64_t ldacc,
                                      int64_t ahead) {
  alignas(64) __m512bh staged[2 * kBandPairs];
  stage_band(pairs, o0, np, k0, valid, ahead, staged);
  const StagedBand<Pairs> band{pairs, staged, o0, pairs.O};
  for (int64_t r0 = 0; r0 < n; r0 += 8)
    with_rows<8>(n - r0, [&](auto R) MOETUNE_AVX512 {
      backward_chunk<decltype(R)::value>(band, o0, np, k0, valid, g + r0 * ldg, ldg, acc + r0 * ldacc, ldacc, 0);
    });
}

// Rows of g from which backward_range reads them from pair_blocks (below 5 the copy costs more than it saves:
// 0.89-0.91x at 1 row, level at 4)
constexpr int64_t kPairBlockRows = 5;

// g [n, Oe] (rows ldg apart, Oe even) for backward_chunk<.., true>: rows_layout.h's row_blocks of g's pairs (block
// r0 from r0 * Oe, the pair q of its row r at (q R + r) * 2; 1.05-1.10x at 7-32 rows on int8 and bf16 weights,
// [1536, 2048]); empty where backward_range with n rows does not read it: a scaled band's g (row-major), fewer than
// kPairBlockRows rows, or more than 8 where staged_band_chunk takes them
template <class Pairs>
MOETUNE_AVX512 inline std::vector<uint16_t> pair_blocks(const uint16_t* g, int64_t ldg, int64_t n, int64_t Oe) {
  if (is_raw_pairs<Pairs>::value || n < kPairBlockRows || (Pairs::kStaged && n > 8)) return {};
  std::vector<uint16_t> dst(n * Oe);
  moetune_rows::row_blocks<4>(g, ldg * 2, n, Oe / 2, dst.data());
  return dst;
}

// backward for output columns [32 c0, 32 c1): g [n, Oe] bf16 with Oe even (pairs; columns past W's rows zero),
// bands of weight row pairs walked along k, the fp32 sums of all n rows in a per-call buffer, rounded into out
// once at the end
template <class Pairs>
MOETUNE_AVX512 inline void backward_range(const Pairs& pairs, const uint16_t* g, int64_t ldg, int64_t n, int64_t K,
                                          int64_t Oe, at::BFloat16* out, int64_t ldo, bool accumulate, int64_t c0,
                                          int64_t c1, const uint16_t* blocked = nullptr) {
  // with wide bands (n > 8) a row's columns and one line, so that the rows are not 4 KiB apart (1.1-1.25x at n = 16
  // to 32 for [1536, 2048]); with up to 8 rows that measured 5-10% slower
  const int64_t width = (c1 - c0) * 32 + (n > 8 ? 16 : 0);
  std::vector<float> accv(n * width, 0.0f);
  float* acc = accv.data() - c0 * 32;  // acc + r * width + k for k in [32 c0, 32 c1)
  constexpr bool kScaled = is_raw_pairs<Pairs>::value;
  // int16 pairs: each band's int32 sums are converted and added into acc, so wider bands from 5 rows (64 pairs, 128
  // from 33: 1.0-1.07x against 32 at 6-128 rows, [1536, 2048] and [2048, 768]; an int32 lane then sums 256
  // products of at most 32767 * 128, below 2^31)
  const int band = kScaled                               ? raw_band_pairs(n)
                   : int16_sums<Pairs>::value && n > 4 ? (n > 32 ? 128 : 64)
                   : band_pairs(n);
  std::vector<uint16_t> scaled(kScaled ? n * 2 * band : 0);  // g times the band's scales (scale_band)
  for (int64_t ob = 0; ob < Oe; ob += 2 * band) {
    const int np = static_cast<int>(std::min<int64_t>(band, (Oe - ob) / 2));
    const uint16_t* gb = g + ob;  // the band's g: g's own columns, or g times the band's scales
    int64_t ldb = ldg, group = -1;
    for (int64_t c = c0; c < c1; ++c) {
      if constexpr (kScaled) {  // new scales where the chunk starts another group of columns
        if (((c * 32) >> pairs.dec.raw_shift()) != group) {
          group = (c * 32) >> pairs.dec.raw_shift();
          scale_band(pairs.dec, g, ldg, n, ob, np, c * 32, pairs.O, scaled.data());
        }
        gb = scaled.data();
        ldb = 2 * np;
      }
      if constexpr (Pairs::kStaged) {
        if (n > 8) {  // the band's pairs decoded once for all blocks of 8 rows
          staged_band_chunk(pairs, ob, np, c * 32, K - c * 32, gb, ldb, n, acc, width, 2 * band);
          continue;
        }
      }
      for (int64_t r0 = 0; r0 < n; r0 += 8)
        with_rows<8>(n - r0, [&](auto R) MOETUNE_AVX512 {
          constexpr int kR = decltype(R)::value;
          const int64_t ahead = r0 == 0 ? 2 * band : 0;
          if (!kScaled && blocked)  // g's own rows as pair_blocks (the scaled g is a band's: row-major)
            backward_chunk<kR, Pairs, true>(pairs, ob, np, c * 32, K - c * 32, blocked + r0 * Oe + ob * kR, 0,
                                            acc + r0 * width, width, ahead);
          else
            backward_chunk<kR>(pairs, ob, np, c * 32, K - c * 32, gb + r0 * ldb, ldb, acc + r0 * width, width,
                               ahead);
        });
    }
  }
  // back to column order where the pairs came permuted: lo holds columns 0-3, 8-11, 16-19, 24-27, hi the others
  const __m512i first16 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i next16 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t c = c0; c < c1; ++c) {
    const int64_t k0 = c * 32;
    for (int64_t r = 0; r < n; ++r) {
      __m512 lo = _mm512_loadu_ps(acc + r * width + k0), hi = _mm512_loadu_ps(acc + r * width + k0 + 16);
      if (Pairs::kPermuted) {
        const __m512 a = _mm512_permutex2var_ps(lo, first16, hi);
        hi = _mm512_permutex2var_ps(lo, next16, hi);
        lo = a;
      }
      if constexpr (int16_sums<Pairs>::value) {  // g's row r was int16 in steps of step[r]
        const __m512 step = _mm512_set1_ps(pairs.step[r]);
        lo = _mm512_mul_ps(lo, step);
        hi = _mm512_mul_ps(hi, step);
      }
      at::BFloat16* dst = out + r * ldo + k0;
      store_row(dst, lo, first(static_cast<int>(K - k0)), accumulate);
      if (K - k0 > 16) store_row(dst + 16, hi, first(static_cast<int>(K - k0 - 16)), accumulate);
    }
  }
}

// g [n, O] (times the fp32 row scale where given, rounded once to bf16: layouts.h's scaled16) into a
// row-major [n, Oe] copy, Oe = O rounded up to even, the last column zero for an odd O
MOETUNE_AVX512 inline std::vector<uint16_t> even_rows(const at::BFloat16* g, int64_t ldg, int64_t n, int64_t O,
                                                      const float* row_scale) {
  const int64_t Oe = (O + 1) / 2 * 2;
  std::vector<uint16_t> dst(n * Oe, 0);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t o = 0; o < O; o += 16) {
      _mm256_mask_storeu_epi16(dst.data() + r * Oe + o, first(static_cast<int>(O - o)),
                               moetune::scaled16(g + r * ldg, o, O, row_scale));
    }
  return dst;
}

// out[n, K] (+)= (g[n, O] * row_scale) @ W, the band walk above: W's pairs from `pairs`
template <class Pairs>
MOETUNE_AVX512 inline void backward(const Pairs& pairs, const at::BFloat16* g, int64_t ldg, int64_t n, int64_t K,
                                    int64_t O, const float* row_scale, at::BFloat16* out, int64_t ldo,
                                    bool accumulate) {
  const int64_t Oe = (O + 1) / 2 * 2;
  std::vector<uint16_t> copy;
  const uint16_t* gp = reinterpret_cast<const uint16_t*>(g);
  if (row_scale || O % 2) {
    copy = even_rows(g, ldg, n, O, row_scale);
    gp = copy.data();
    ldg = Oe;
  }
  const std::vector<uint16_t> blocks = pair_blocks<Pairs>(gp, ldg, n, Oe);
  at::parallel_for(0, (K + 31) / 32, 1, [&](int64_t c0, int64_t c1) {
    backward_range(pairs, gp, ldg, n, K, Oe, out, ldo, accumulate, c0, c1, blocks.empty() ? nullptr : blocks.data());
  });
}

}  // namespace moetune_few_rows

namespace {

// run_gemm (entry.h's contract) for weights stored in bf16: these loops instead of a variant's decoding ones
void run_gemm(bool forward, const moetune::Bf16Rows& dec, const float* /*row_scale: none*/, const torch::Tensor& a,
              torch::Tensor& out, int64_t O, int64_t K, bool accumulate) {
  const int64_t n = a.size(0), lda = a.stride(0), ldo = out.stride(0);
  const auto* w = reinterpret_cast<const uint16_t*>(dec.w);
  const at::BFloat16* ap = a.data_ptr<at::BFloat16>();
  auto* op = out.data_ptr<at::BFloat16>();
  if (forward) {
    at::parallel_for(0, (O + 15) / 16, 1, [&](int64_t b0, int64_t b1) {
      moetune_few_rows::forward_range(w, dec.ld, reinterpret_cast<const uint16_t*>(ap), lda, n, K, O, op, ldo,
                                      accumulate, b0, b1);
    });
    return;
  }
  const std::vector<uint16_t> zero(K + 32, 0);
  moetune_few_rows::backward(moetune_few_rows::Bf16Pairs{w, dec.ld, O, zero.data()}, ap, lda, n, K, O, nullptr, op,
                             ldo, accumulate);
}

}  // namespace
