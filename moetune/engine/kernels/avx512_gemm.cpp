// Fused quantized-weight GEMMs on AVX512-BF16 (no AMX): codes read from memory, dequantized in registers by the
// shared decoders (decoders.h), multiplied with vdpbf16ps (pairs of bf16 products summed into fp32 lanes).
// Same products, roundings and Python API as amx_gemm.cpp (see its header and entry.h):
//
//   forward : out[n, O] (+)= x[n, K] @ W^T     up to 8-32 rows (dot_rows): lanes along k, acc[r][o] +=
//             x[r, k..k+32) . W[o, k..k+32), W's 32 values of a row decoded once per 8 rows of x and used for all
//             of them, two weight rows at a time, the accumulators summed across their lanes at the end of the rows
//             (reduce16 from 4 rows of x: 1.04-1.26x); fp8_block in its group-scaled form there (x times the block
//             scales, rounded once to bf16, against the codes' values: fp8_scaled_x); more rows: four weight rows
//             decoded once into an L1 buffer, then dense bf16's loop on them (forward_decoded).
//   backward: out[n, K] (+)= g[n, O] @ W      lanes along k: acc[r][k..k+16) += bcast(g[r, o:o+2]) . pairs
//             (W[o, k..k+16), W[o+1, k..k+16)) (layouts.h's pair layout). Group-scaled weights (int4 with groups
//             of >= 32, fp8_block, mxfp4; decoders.h) with up to 8-32 rows of g (by the columns a scale covers:
//             use_raw_pairs): few_rows.h's band walk on their raw values, g times the scales rounded once to bf16
//             (RawPairs32: 1.03-1.8x against the paths below; fp8_block and mxfp4 decoded between the dot
//             products at 6-8 rows: raw_staged). More rows: the band walk on the weights' bf16 values
//             (DecodedPairs32 by table, staged).
//
// Weights stored in bf16 (dense experts, moetune::Bf16Rows) take few_rows.h's own loops (no decoding); int8 weights
// take int16_rows.h's (x, or g times the row scales, as 16-bit integers per row against the codes, by vpdpwssd:
// 1.0-1.4x the bf16 dot products' path it replaces at 1-128 rows, whose decode was 5 instructions per 32 codes).
//
// Each weight is decoded once per call for up to 8 rows (the engine's few-row experts), so the loops stream the
// codes once.
#define MOETUNE_VARIANT "AVX512-BF16"
#define MOETUNE_TABLES  // fp8_block by table (entry.h)
#define MOETUNE_A8_INT8  // int8_gemm_a8 (entry.h, int8_rows.h)
#define MOETUNE_A8_INT4  // int4_gemm_a8 (entry.h: int4_a8 below, int8_rows.h)

#include "decoders.h"
#include "few_rows.h"  // the band walk (backward, <= 8 rows) and run_gemm for dense bf16 weights
#include "int16_rows.h"  // int8 weights against int16 rows (vpdpwssd)
#include "int8_rows.h"   // the same against int8 rows (vpdpbusd): int8_gemm_a8
#include "layouts.h"

#include <ATen/Parallel.h>
#include <cpuid.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using moetune::first;
using moetune::store_row;

constexpr int kRows = 8;  // rows of x / g per register block: 2 x 8 accumulators + operands fit 32 zmm
// forward_rows prefetches the weight rows this many pairs ahead (a line per 64 columns, as it reaches them): it
// took int8's [1536, 2048] forward at n = 8 from 0.74 to 0.54 ms, [2048, 768] from 0.37 to 0.22 ms (one thread)
constexpr int kAheadPairs = 2;
// backward past the group-scaled form's rows: few_rows.h's band walk on the weights' bf16 values, each band's pairs
// decoded once for all blocks of 8 rows (staged). Against the strips it replaced (each 32 x 64 block of W decoded
// once into L1, g's pairs broadcast from a re-laid copy): int4 1.07-1.5x, mxfp4 1.0-1.08x at 9-192 rows, fp8_block
// 1.04-1.14x at 33-128 rows (2026-12-06), [1536, 2048] and [2048, 768]; the walk decoding per block of 8 rows
// instead measured 0.5-0.9x against the strips above 8 (fp8's, and int8's in bf16 before int16_rows.h).

using moetune_few_rows::with_rows;

// Why not usable here, or "" when AVX512F/BW/VL and AVX512-BF16 are.
std::string variant_unavailable() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return "CPUID leaf 7 is missing";
  if (!((b & (1u << 16)) && (b & (1u << 30)) && (b & (1u << 31)))) return "the CPU has no AVX512F/BW/VL";
  if (!(c & (1u << 11))) return "the CPU has no AVX512-VNNI";
  if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !(a & (1u << 5))) return "the CPU has no AVX512-BF16";
  return "";
}

// W[o, k0 .. k0 + 32) as 32 bf16 in k order (zero past K: valid = K - k0)
template <class Dec>
MOETUNE_AVX512 inline __m512bh chunk(const Dec& dec, int64_t o, int64_t k0, int valid) {
  return (__m512bh)moetune::bf16_chunk(dec, o, k0, valid);
}

// forward_rows' tables: none (each chunk decoded alone), each row's last kept while its group lasts, or each row's
// made first (the decoder's row_tables: int4 with whole rows)
constexpr int kNoTables = 0, kKeptTables = 1, kRowTables = 2;

// res[r * 16 + j] = sum_k x[r, k] W[o0 + j, k] (fp32) for r < R, j < rows (up to 16 weight rows from o0);
// rows_ahead: weight rows from o0 to O (the prefetched ones stay inside W). kTables: kKeptTables, each row's table
// kept while its group of columns lasts (decoders.h's TableCache; int4 with groups of 64 or more: 1.08-1.36x at 1-32
// rows, and 0.95-0.97x with groups of 32, which therefore do not keep them); kRowTables, each pair of rows' tables
// made first (symmetric int4 with whole rows: 1.09-1.30x against those)
template <int R, int kTables, class Dec>
MOETUNE_AVX512 void forward_rows(const Dec& dec, const at::BFloat16* x, int64_t ldx, int64_t K, int64_t o0,
                                 int rows, float* res, int rows_ahead) {
  moetune::RowTables t0, t1;  // (kTables == kRowTables)
  for (int j = 0; j < rows; j += 2) {
    const int64_t o = o0 + j;
    const bool two = j + 1 < rows;
    __m512 acc0[R], acc1[R];
    for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
    moetune::TableCache cache0, cache1;
    if constexpr (kTables == kRowTables) {
      dec.row_tables(o, t0);
      if (two) dec.row_tables(o + 1, t1);
    }
    // valid: K - k0, at most 32 (a literal 32 in the main loop, so the decoders' masks fold to constants)
    auto step = [&](int64_t k0, int valid) MOETUNE_AVX512 {
      const __mmask32 m = moetune::first32(valid);
      if (k0 % 64 == 0 && j + 2 * kAheadPairs + 1 < rows_ahead) {  // the rows kAheadPairs ahead, this column
        moetune::prefetch<_MM_HINT_T2>(dec, o + 2 * kAheadPairs, k0);
        moetune::prefetch<_MM_HINT_T2>(dec, o + 2 * kAheadPairs + 1, k0);
      }
      __m512bh w0, w1 = (__m512bh)_mm512_setzero_si512();
      if constexpr (kTables == kRowTables) {
        w0 = (__m512bh)dec.row_chunk(o, k0, t0);
        if (two) w1 = (__m512bh)dec.row_chunk(o + 1, k0, t1);
      } else if constexpr (kTables == kKeptTables) {
        w0 = (__m512bh)moetune::bf16_chunk(dec, o, k0, valid, cache0);
        if (two) w1 = (__m512bh)moetune::bf16_chunk(dec, o + 1, k0, valid, cache1);
      } else {
        w0 = chunk(dec, o, k0, valid);
        if (two) w1 = chunk(dec, o + 1, k0, valid);
      }
      for (int r = 0; r < R; ++r) {  // x past K masked to zero: the next row's values could be inf or nan
        const __m512bh xr = (__m512bh)_mm512_maskz_loadu_epi16(m, x + r * ldx + k0);
        acc0[r] = _mm512_dpbf16_ps(acc0[r], xr, w0);
        acc1[r] = _mm512_dpbf16_ps(acc1[r], xr, w1);
      }
    };
    int64_t k0 = 0;
    for (; k0 + 32 <= K; k0 += 32) step(k0, 32);
    if (k0 < K) step(k0, static_cast<int>(K - k0));
    moetune_few_rows::pair_sums<R>(acc0, acc1, two, res, j);
  }
}

// whether forward_rows keeps each row's table while its group lasts (decoders.h's table_lasts)
template <class Dec>
inline bool keep_tables(const Dec& dec) {
  if constexpr (moetune::has_cached_table<Dec>::value) return dec.table_lasts();
  return false;
}

// acc [n, 16] = x [n, K] @ W[o0 .. o0 + rows)^T with the weights decoded once: each four weight rows' bf16 values
// into an L1 buffer (buf: 4 rows of ld >= K, 64-byte aligned; whole rows by the decoder's bf16_row where it has one),
// then few_rows.h's forward_group on them, four rows of x at a time (dense bf16's own loop), while the next four
// rows' codes are prefetched into L2 (1.01-1.10x at 33-128 rows, int4 / fp8_block / mxfp4)
template <class Dec>
MOETUNE_AVX512 void forward_decoded(const Dec& dec, const at::BFloat16* x, int64_t ldx, int64_t n, int64_t K,
                                    int64_t o0, int rows, float* acc, uint16_t* buf, int64_t ld) {
  const auto* xp = reinterpret_cast<const uint16_t*>(x);
  for (int j0 = 0; j0 < rows; j0 += 4) {
    const int group = std::min(4, rows - j0);
    for (int j = 0; j < group; ++j) {
      if constexpr (moetune::has_bf16_row<Dec>::value) {
        if (dec.whole_rows()) {
          dec.bf16_row(o0 + j0 + j, buf + j * ld);
          continue;
        }
      }
      moetune::TableCache cache;
      for (int64_t k0 = 0; k0 < K; k0 += 32) {
        const int valid = static_cast<int>(std::min<int64_t>(32, K - k0));
        _mm512_store_si512(buf + j * ld + k0, keep_tables(dec) ? moetune::bf16_chunk(dec, o0 + j0 + j, k0, valid, cache)
                                                               : moetune::bf16_chunk(dec, o0 + j0 + j, k0, valid));
      }
    }
    if (j0 + 4 < rows) {  // the next four rows' codes into L2 while these are multiplied
      const char* a = static_cast<const char*>(dec.code(o0 + j0 + 4, 0));
      const char* b = static_cast<const char*>(dec.code(o0 + std::min(j0 + 8, rows) - 1, K - 1));
      for (; a <= b; a += 64) moetune::prefetch_line<_MM_HINT_T2>(a);
    }
    const uint16_t* wr[4];
    for (int j = 0; j < 4; ++j) wr[j] = buf + std::min(j, group - 1) * ld;
    for (int64_t r0 = 0; r0 < n; r0 += 4) {
      alignas(64) float sums[16];
      with_rows<4>(n - r0, [&](auto R) MOETUNE_AVX512 {
        moetune_few_rows::forward_group<decltype(R)::value>(wr, xp + r0 * ldx, ldx, K, ld, buf, 0, 0, sums);
      });
      for (int64_t r = 0; r < std::min<int64_t>(4, n - r0); ++r)
        for (int j = 0; j < group; ++j) acc[(r0 + r) * 16 + j0 + j] = sums[j * 4 + r];
    }
  }
}

// acc [n, 16] = x [n, K] @ W[o0 .. o0 + rows)^T by dot products, 8 rows of x at a time (forward_rows; a second
// block finds the 16 weight rows in L1)
template <class Dec>
MOETUNE_AVX512 void forward_dots(const Dec& dec, const at::BFloat16* x, int64_t ldx, int64_t n, int64_t K,
                                 int64_t o0, int rows, float* acc, int ahead) {
  for (int64_t r0 = 0; r0 < n; r0 += kRows) {
    const at::BFloat16* xr = x + r0 * ldx;
    float* res = acc + r0 * 16;
    with_rows<kRows>(n - r0, [&](auto R) MOETUNE_AVX512 {
      if constexpr (moetune::has_bf16_row<Dec>::value) {
        if (dec.dot_row_tables()) {
          forward_rows<decltype(R)::value, kRowTables>(dec, xr, ldx, K, o0, rows, res, ahead);
          return;
        }
      }
      if (keep_tables(dec))
        forward_rows<decltype(R)::value, kKeptTables>(dec, xr, ldx, K, o0, rows, res, ahead);
      else
        forward_rows<decltype(R)::value, kNoTables>(dec, xr, ldx, K, o0, rows, res, ahead);
    });
  }
}

// fp8_block's forward by dot products in its group-scaled form (decoders.h): x times the block scales, rounded once
// to bf16, against the codes' values V (Fp8Values: integer operations, where each weight's own bf16 value needs a
// table lookup per 32 codes: 1.4-1.6x at 1-32 rows, docs/performance.md, "fp8_block: the codes' values by integer
// operations"). Taken where every 16 weight rows of an output block lie in one grid row of blocks (so x is scaled
// once per grid row): up's rows start on a multiple of 16 (seg % 16 == 0; gate's and down's blocks are 128 rows).
template <class Dec>
inline bool fp8_scaled_x(const Dec& dec) {
  if constexpr (std::is_same_v<Dec, moetune::Fp8BlockRows>) return dec.seg % 16 == 0;
  return false;
}

// xs [n, K] = x [n, K] times grid row gr's block scales (each 128 columns' scale_inv * 2^8, in fp32), rounded once
// to bf16 (the group-scaled form's x, as few_rows.h's scale_band makes the backward's g)
MOETUNE_AVX512 void scale_x(const moetune::Fp8BlockRows& dec, int64_t gr, const at::BFloat16* x, int64_t ldx,
                            int64_t n, int64_t K, uint16_t* xs) {
  for (int64_t r = 0; r < n; ++r)
    for (int64_t k0 = 0; k0 < K; k0 += 16) {
      const __m512 s = _mm512_set1_ps(dec.scale_inv[gr * dec.cols + (k0 >> 7)] * 256.0f);
      _mm256_mask_storeu_epi16(xs + r * K + k0, first(static_cast<int>(K - k0)),
                               (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(moetune::widen16(x + r * ldx, k0, K), s)));
    }
}

// Rows of x up to which the forward takes dot products (forward_dots: W decoded again per 8 rows, in registers);
// more take forward_decoded (each weight decoded once, then dense bf16's loop). Measured crossings (AMD EPYC Zen 4,
// one thread, [1536, 2048] and [2048, 768], docs/performance.md "The forward with many rows" and "int4's rows
// decoded with their tables made first"): int4 whose rows its decoder writes whole (bf16_row: groups of 32-128
// columns, K/2 a multiple of 32) at 8 (forward_decoded 1.10-1.54x at 9-24 rows, 0.82-1.36x at 1-8); other int4 with
// groups of 32 or zero points, and mxfp4, at 12-16 rows (forward_decoded 0.93-1.10x there, 1.08-1.28x at 24-32);
// other int4 keeping its tables (groups of >= 64) at 24 (0.99-1.03x; 1.07-1.11x at 32); fp8_block, whose dot
// products take x times its scales, at 32 (0.94-1.02x at 24-32, 1.23x at 33).
template <class Dec>
inline int64_t dot_rows(const Dec& dec) {
  if constexpr (std::is_same_v<Dec, moetune::Fp8BlockRows>) return 32;
  if constexpr (moetune::has_bf16_row<Dec>::value) {
    if (dec.whole_rows()) return 8;  // int4 by bf16_row: 1.10-1.54x against the dot products at 9-24 rows
  }
  return keep_tables(dec) ? 24 : 16;
}

// Forward, output columns (weight rows) [16 ob0, 16 ob1), 16 at a time: up to dot_rows rows of x by dot
// products (forward_dots; fp8_block on x times its scales where fp8_scaled_x), more by forward_decoded.
template <class Dec>
MOETUNE_AVX512 void forward_range(const Dec& dec, const float* row_scale, const at::BFloat16* x, int64_t ldx,
                                  int64_t n, int64_t K, int64_t O, at::BFloat16* out, int64_t ldo, bool accumulate,
                                  int64_t ob0, int64_t ob1) {
  std::vector<float> res(std::max<int64_t>(n, kRows) * 16 + 16);  // [n, 16] fp32 sums
  float* acc = res.data() + (16 - reinterpret_cast<uintptr_t>(res.data()) / 4 % 16) % 16;  // 64-byte aligned
  const bool dots = n <= dot_rows(dec);
  const bool scaled = dots && fp8_scaled_x(dec);
  std::vector<uint16_t> xs(scaled ? n * K : 0);  // x times one grid row's scales (scale_x)
  int64_t xs_row = -1;  // that grid row
  const int64_t wld = (K + 31) / 32 * 32 + 32;  // forward_decoded's rows: a line past a multiple of 32 columns
  std::vector<uint16_t> wdec(dots ? 0 : 4 * wld + 32);
  uint16_t* wbuf = wdec.data() + (32 - reinterpret_cast<uintptr_t>(wdec.data()) / 2 % 32) % 32;
  for (int64_t ob = ob0; ob < ob1; ++ob) {
    const int64_t o0 = ob * 16;
    const int rows = static_cast<int>(std::min<int64_t>(16, O - o0));
    const __mmask16 m = first(rows);
    const __m512 scale = row_scale ? _mm512_maskz_loadu_ps(m, row_scale + o0) : _mm512_set1_ps(1.0f);
    const int ahead = static_cast<int>(O - o0);
    if (!dots) {
      forward_decoded(dec, x, ldx, n, K, o0, rows, acc, wbuf, wld);
    } else if (scaled) {
      if constexpr (std::is_same_v<Dec, moetune::Fp8BlockRows>) {  // (scaled: fp8_block only)
        if (dec.grid_row(o0) != xs_row) {
          xs_row = dec.grid_row(o0);
          scale_x(dec, xs_row, x, ldx, n, K, xs.data());
        }
        forward_dots(moetune::Fp8Values{dec}, reinterpret_cast<const at::BFloat16*>(xs.data()), K, n, K, o0, rows,
                     acc, ahead);
      }
    } else {
      forward_dots(dec, x, ldx, n, K, o0, rows, acc, ahead);
    }
    for (int64_t r = 0; r < n; ++r)
      store_row(out + r * ldo + o0, _mm512_mul_ps(_mm512_load_ps(acc + r * 16), scale), m, accumulate);
  }
}

template <class Dec>
void run_gemm(bool forward, const Dec& dec, const float* row_scale, const torch::Tensor& a, torch::Tensor& out,
              int64_t O, int64_t K, bool accumulate) {
  const int64_t n = a.size(0);
  const auto* ap = a.data_ptr<at::BFloat16>();
  auto* op = out.data_ptr<at::BFloat16>();
  const int64_t lda = a.stride(0), ldo = out.stride(0);
  if constexpr (std::is_same_v<Dec, moetune::Int8Rows>) {  // int16 rows against the codes (int16_rows.h)
    if (forward)
      moetune_int16::forward(dec, row_scale, ap, lda, n, K, O, op, ldo, accumulate);
    else
      moetune_int16::backward(dec, row_scale, ap, lda, n, K, O, op, ldo, accumulate);
  } else {
    if (forward) {
      at::parallel_for(0, (O + 15) / 16, 1, [&](int64_t b0, int64_t b1) {
        forward_range(dec, row_scale, ap, lda, n, K, O, op, ldo, accumulate, b0, b1);
      });
      return;
    }
    if constexpr (moetune_few_rows::has_raw<Dec>::value) {
      if (moetune_few_rows::use_raw_pairs(dec, n)) {  // the scales into g: few_rows.h's RawPairs32
        auto walk = [&](auto pairs) {
          moetune_few_rows::backward(pairs, ap, lda, n, K, O, row_scale, op, ldo, accumulate);
        };
        if (moetune_few_rows::raw_staged<Dec>(n))
          walk(moetune_few_rows::RawPairs32<Dec, true>{dec, O});
        else
          walk(moetune_few_rows::RawPairs32<Dec, false>{dec, O});
        return;
      }
    }
    // past the group-scaled form's rows: bands of weight rows walked along k on the weights' bf16 values (few_rows.h)
    moetune_few_rows::backward(moetune_few_rows::DecodedPairs32<Dec>{dec, O}, ap, lda, n, K, O, row_scale, op, ldo,
                               accumulate);
  }
}

// int4_gemm_a8's products (entry.h): x, or g, as 8-bit integer rows (int8_rows.h)
void int4_a8(bool forward, const moetune::Int4Rows& dec, const torch::Tensor& a, torch::Tensor& out, int64_t O,
             int64_t K, bool accumulate) {
  const auto* ap = a.data_ptr<at::BFloat16>();
  auto* op = out.data_ptr<at::BFloat16>();
  if (forward)
    moetune_int8::int4_forward(dec, ap, a.stride(0), a.size(0), K, O, op, out.stride(0), accumulate);
  else
    moetune_int8::int4_backward(dec, ap, a.stride(0), a.size(0), K, O, op, out.stride(0), accumulate);
}

}  // namespace

#include "entry.h"
