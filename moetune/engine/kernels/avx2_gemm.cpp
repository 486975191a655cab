// Fused quantized-weight GEMMs on AVX2 + FMA (CPUs without AVX512-BF16 or AMX, where the engine computes in
// fp32): codes read from memory, dequantized in registers by the shared decoders' 8-lane form (decoders.h,
// ``eight``), multiplied in fp32 by FMA. Operands and out are fp32 (entry.h's API with MOETUNE_OPERANDS fp32):
//
//   forward : out[n, O] (+)= (x[n, K] @ W^T) * row_scale   4 weight rows at a time, K in chunks of kChunk: the
//             4 x kChunk block decoded once into L1 (a row at a time: decode_row) and used by every row of x,
//             kRows rows per register block, lanes along k (acc[r][j] += x[r, k..k+8) * W[o0 + j, k..k+8)), each
//             sum reduced once per chunk; the next block's codes prefetched meanwhile (rows of >= 1 KiB of codes).
//             From kTransposedMinRows rows of x (no row_scale: every format but int8) it is the backward's product
//             with V = W^T, on the backward's loops: V's blocks decoded 8 x 8 and transposed in registers.
//   backward: out[n, K] (+)= (g[n, O] * row_scale) @ W      blocks of W (32 rows x 128 columns for n <= 32, else
//             128 x 32) decoded once into L1 (decode_row) and used by every row of g, a row block's column blocks
//             in turn, kGRows rows x 16 columns per register block, lanes along k (acc[r][k..k+8) +=
//             bcast(g[r, o]) * W[o, k..k+8)), the [n, columns] sums in a per-thread buffer; the next block's codes
//             prefetched meanwhile (where 128 columns of a row take >= 128 bytes).
//
// int8 runs the same loops on other lanes (avx2_int16.h): its codes widened to int16 against x, or g times the row
// scale, as 16-bit integer rows (steps of each row's largest magnitude / 32767), by vpmaddwd, exact int32 sums.
// Every weight is decoded once per call whatever n is, so the loops stream the codes once; all sums are fp32.
#define MOETUNE_VARIANT "AVX2"
#define MOETUNE_OPERANDS at::kFloat
#define MOETUNE_A8_INT4  // int4_gemm_a8 (entry.h: int4_a8 below, avx2_int8.h)

#include "avx2_int16.h"
#include "avx2_int8.h"
#include "decoders.h"

#include <ATen/Parallel.h>
#include <cpuid.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

namespace {

constexpr int kWRows = 4;  // forward: weight rows (output columns) per block
constexpr int64_t kChunk = 512;  // forward: columns of W per decoded block (4 x 512 fp32 = 8 KiB of L1)
// forward: the next block's codes are prefetched (into L2) while a block is multiplied where a row of W's codes is
// at least this long (a 4 KiB page holds at most four rows: the hardware's stream prefetcher, which stops at pages,
// restarts on every block). K = 2048 (bytes per row: bf16 4096, int8 / fp8_block 2048): 1.05-1.3x at 1-32 rows of x
// (Zen 1); int4 / mxfp4 at K = 2048 (1024 bytes): 0.76-1.09x on Zen 1, 1.05-1.21x on Zen 3 (gate_up, 4-32 rows),
// so 1024 is in; K = 768 (int8 / fp8_block 768 bytes, int4 / mxfp4 384): 0.88-1.02x on Zen 3 with 512 here, so out
// (bf16 at K = 768, 1536 bytes: 1.05-1.13x) (bench/kernel_ab.py --variant AVX2)
constexpr int64_t kPrefetchMinRowBytes = 1024;
constexpr int64_t kBRows = 32, kBCols = 128;  // backward, up to 32 rows of g: W's decoded blocks (16 KiB of L1)
// backward: the next block's codes are prefetched (into L2) while a block is multiplied where 128 columns of a W row
// take at least this many bytes (two cache lines): bf16, int8, fp8_block and int4 (whose 128 columns' low or high
// nibbles fill 128 bytes), 1.0-1.5x at 1-32 rows of g; mxfp4 (64 bytes, its rows' codes in one run) 0.92-0.98x
// (Zen 1, bench/kernel_ab.py)
constexpr int64_t kBackPrefetchMinRunBytes = 128;
// forward: from this many rows of x, out = x @ W^T runs on the backward's loops over V = W^T (TransposedLanes,
// below): the forward's own loops (lanes along k, x's rows re-read from L2 per 4 weight rows) ran at 57-62 GFLOP/s
// from 64 rows where the backward's ran at 75-80 (Zen 3, bf16 gate_up, one thread). Against them (bench/kernel_ab.py,
// Zen 3): 1.04-1.17x at 112 rows for bf16, int4 and fp8_block, 1.07-1.36x at 128-256 for every format; at 96 bf16
// and int4 1.06-1.25x but fp8_block 0.96-0.99x (its codes' `eight` costs more than a run's decoding), at 48-64
// int4 and fp8_block 0.85-0.95x
constexpr int64_t kTransposedMinRows = 112;

// Why not usable here, or "" when AVX2, FMA and F16C are.
std::string variant_unavailable() {
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return "CPUID leaf 1 is missing";
  if (!((c & (1u << 12)) && (c & (1u << 29)))) return "the CPU has no FMA/F16C";
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(b & (1u << 5))) return "the CPU has no AVX2";
  return "";
}

template <class Dec, class = void>
struct has_span8 : std::false_type {};
template <class Dec>
struct has_span8<Dec, std::void_t<decltype(std::declval<const Dec&>().span8(0, 0, 0, nullptr))>> : std::true_type {};

// W[o, k0 .. k0 + cols) into dst (aligned), rounded up to whole 8s, zero past K: the decoder's span8 where it has one
// and the columns are whole 8s inside K, else 8 at a time
template <class Dec>
MOETUNE_AVX2 inline void decode_row(const Dec& dec, int64_t o, int64_t k0, int64_t cols, int64_t K, float* dst) {
  if constexpr (has_span8<Dec>::value) {
    if (cols % 8 == 0 && k0 + cols <= K) {
      dec.span8(o, k0, cols, dst);
      return;
    }
  }
  for (int64_t c = 0; c < cols; c += 8) _mm256_store_ps(dst + c, dec.eight(o, k0 + c, static_cast<int>(K - k0 - c)));
}

// The bytes that the codes of W[o, k0 .. k1] span (k1 inclusive; int4: both on one side of K / 2, or 0 and K - 1)
template <class Dec>
inline int64_t span_bytes(const Dec& dec, int64_t o, int64_t k0, int64_t k1) {
  return static_cast<const char*>(dec.code(o, k1)) - static_cast<const char*>(dec.code(o, k0)) + 1;
}

using moetune_avx2_int16::hsum;
using moetune_avx2_int16::with_rows;  // register blocks' row counts as template arguments
using moetune_avx2_int16::lanes;  // lanes below `valid` (0 .. 8) all ones: maskload / maskstore's mask

// v (+ the values at dst) -> dst for the first `valid` lanes (<= 8)
MOETUNE_AVX2 inline void store_lanes(float* dst, __m256 v, int valid, bool accumulate) {
  if (valid >= 8) {
    _mm256_storeu_ps(dst, accumulate ? _mm256_add_ps(_mm256_loadu_ps(dst), v) : v);
    return;
  }
  const __m256i m = lanes(valid);
  if (accumulate) v = _mm256_add_ps(_mm256_maskload_ps(dst, m), v);
  _mm256_maskstore_ps(dst, m, v);
}

// The codes of a forward block's kWRows rows: row j's run from row[j], `bytes` long (0: nothing to prefetch).
struct Codes {
  const char* row[kWRows];
  int64_t bytes = 0;
};

// the `line`-th prefetch of a block's next codes (the rows in turn, a cache line each), where it lies in their runs
MOETUNE_AVX2 inline void prefetch_ahead(const Codes& ahead, int64_t line) {
  const int64_t at = line / kWRows * 64;
  if (at < ahead.bytes) _mm_prefetch(ahead.row[line % kWRows] + at, _MM_HINT_T2);
}

// res[r * 4 + j] += sum over the chunk's columns of x[r, k0 + c] w[j * kChunk + c] for r < R, j < 4: x row r
// at x + r * ldx (already at k0), `full` columns in whole 8s then `tail` (< 8) more (x past them not read); a
// cache line of `ahead` prefetched per 8 columns, the rows in turn (a whole chunk's kChunk / 8 steps cover 4 runs of
// <= 2 kChunk bytes, bf16's; a K's last, shorter chunk the first part of them).
template <int R>
MOETUNE_AVX2 void forward_block(const float* w, const float* x, int64_t ldx, int64_t full, int tail, float* res,
                                const Codes& ahead) {
  __m256 acc[R][kWRows];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kWRows; ++j) acc[r][j] = _mm256_setzero_ps();
  auto step = [&](int64_t c, __m256 xr[R]) MOETUNE_AVX2 {
    for (int j = 0; j < kWRows; ++j) {
      const __m256 wj = _mm256_load_ps(w + j * kChunk + c);
      for (int r = 0; r < R; ++r) acc[r][j] = _mm256_fmadd_ps(xr[r], wj, acc[r][j]);
    }
  };
  for (int64_t c = 0; c < full; c += 8) {
    prefetch_ahead(ahead, c / 8);
    __m256 xr[R];
    for (int r = 0; r < R; ++r) xr[r] = _mm256_loadu_ps(x + r * ldx + c);
    step(c, xr);
  }
  if (tail) {
    __m256 xr[R];
    for (int r = 0; r < R; ++r) xr[r] = _mm256_maskload_ps(x + r * ldx + full, lanes(tail));
    step(full, xr);
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kWRows; ++j) res[r * kWRows + j] += hsum(acc[r][j]);
}

// Forward, output columns [4 ob0, 4 ob1), on Lanes (below): x's rows of Lanes::A, times row_step[r] where given
template <class Lanes, class Dec>
MOETUNE_AVX2 void forward_range(const Dec& dec, const float* row_scale, const typename Lanes::A* x, int64_t ldx,
                                const float* row_step, int64_t n, int64_t K, int64_t O, float* out, int64_t ldo,
                                bool accumulate, int64_t ob0, int64_t ob1) {
  alignas(32) typename Lanes::W w[kWRows * kChunk];
  std::vector<float> res(n * kWRows);
  const bool ahead_rows = span_bytes(dec, 0, 0, K - 1) >= kPrefetchMinRowBytes;
  for (int64_t ob = ob0; ob < ob1; ++ob) {
    const int64_t o0 = ob * kWRows;
    const int rows = static_cast<int>(std::min<int64_t>(kWRows, O - o0));
    std::fill(res.begin(), res.end(), 0.0f);
    for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
      const int64_t cols = std::min<int64_t>(kChunk, K - k0);
      for (int j = 0; j < kWRows; ++j) {
        if (j < rows)
          Lanes::decode(dec, o0 + j, k0, cols, K, w + j * kChunk);
        else
          std::fill_n(w + j * kChunk, (cols + Lanes::kCols - 1) / Lanes::kCols * Lanes::kCols, 0);
      }
      // the next block (the next chunk of these rows, else the next rows' first), for the first register block
      Codes ahead, none;
      const bool along = k0 + kChunk < K;
      const int64_t nk = along ? k0 + kChunk : 0, no = along ? o0 : o0 + kWRows;
      if (ahead_rows && (along || ob + 1 < ob1) && no + kWRows <= O) {
        for (int j = 0; j < kWRows; ++j) ahead.row[j] = static_cast<const char*>(dec.code(no + j, nk));
        const int64_t last = std::min<int64_t>(kChunk, K - nk) - 1;
        ahead.bytes = span_bytes(dec, no, nk, nk + last);
      }
      for (int64_t r0 = 0; r0 < n; r0 += Lanes::kRows)
        with_rows<Lanes::kRows>(n - r0, [&](auto R) MOETUNE_AVX2 {
          Lanes::template forward<decltype(R)::value>(w, x + r0 * ldx + k0, ldx, cols, res.data() + r0 * kWRows,
                                                      r0 == 0 ? ahead : none);
        });
    }
    for (int64_t r = 0; r < n; ++r)
      for (int j = 0; j < rows; ++j) {
        const float v =
            res[r * kWRows + j] * (row_step ? row_step[r] : 1.0f) * (row_scale ? row_scale[o0 + j] : 1.0f);
        float& dst = out[r * ldo + o0 + j];
        dst = accumulate ? dst + v : v;
      }
  }
}

// acc[r][0 .. 32) += g[r, o0 .. o0 + rows) @ w[0 .. rows) for r < R: w 32 columns of a decoded block, row o at
// w + o * ldw, g row r at g + r * ldg (already at o0), acc row r at acc + r * lda; 16 columns per pass.
template <int R>
MOETUNE_AVX2 void backward_block(const float* w, int64_t ldw, int rows, const float* g, int64_t ldg, float* acc,
                                 int64_t lda) {
  for (int h = 0; h < 32; h += 16) {
    __m256 c0[R], c1[R];
    for (int r = 0; r < R; ++r) {
      c0[r] = _mm256_loadu_ps(acc + r * lda + h);
      c1[r] = _mm256_loadu_ps(acc + r * lda + h + 8);
    }
    for (int o = 0; o < rows; ++o) {
      const __m256 w0 = _mm256_load_ps(w + o * ldw + h), w1 = _mm256_load_ps(w + o * ldw + h + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 b = _mm256_broadcast_ss(g + r * ldg + o);
        c0[r] = _mm256_fmadd_ps(b, w0, c0[r]);
        c1[r] = _mm256_fmadd_ps(b, w1, c1[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(acc + r * lda + h, c0[r]);
      _mm256_storeu_ps(acc + r * lda + h + 8, c1[r]);
    }
  }
}

// Prefetch (into L2) the i-th of m shares of the codes of W[no .. no + rows, k0 .. k1] (k1 inclusive): in each row's
// run, the cache lines i, i + m, i + 2m, ... (a prefetch never faults)
template <class Dec>
MOETUNE_AVX2 inline void prefetch_share(const Dec& dec, int64_t no, int64_t rows, int64_t k0, int64_t k1, int64_t i,
                                        int64_t m) {
  for (int64_t o = 0; o < rows; ++o) {
    const auto first = reinterpret_cast<uintptr_t>(dec.code(no + o, k0)) & ~uintptr_t{63};
    const auto last = reinterpret_cast<uintptr_t>(dec.code(no + o, k1));
    for (uintptr_t line = first + 64 * i; line <= last; line += 64 * m)
      moetune::prefetch_line<_MM_HINT_T2>(reinterpret_cast<const void*>(line));
  }
}

// Backward, output columns [32 s0, 32 s1) (g: [n, O] already times the row scale; on Lanes, below: rows of
// Lanes::A, the sums times row_step[r] where given). Blocks of W, a row block's column blocks in turn, each decoded
// once into L1 (Lanes::decode_block: a row's run at a time) and taken 32 columns at a time by every row of g; the
// [n, 32 (s1 - s0)] sums in a per-thread buffer. Up to 32 rows of g the blocks are kBRows x kBCols: each row's
// codes read 128 columns at a time (bf16 1.3-1.8x, int4 1.1-1.3x at 1-8 rows against 128 x 32 blocks, whose
// 32-column runs, one per row of W, read 64 bytes from each of 128 rows); more rows of g keep 128 x 32 (each
// register block's sums loaded and stored once per 128 rows of W, not 32; level at 64-256).
template <class Lanes, class Dec>
MOETUNE_AVX2 void backward_range(const Dec& dec, const typename Lanes::A* g, int64_t ldg, const float* row_step,
                                 int64_t n, int64_t K, int64_t O, float* out, int64_t ldo, bool accumulate,
                                 int64_t s0, int64_t s1) {
  alignas(32) typename Lanes::W w[kBRows * kBCols];
  const int64_t bR = n > 32 ? kBCols : kBRows, bC = n > 32 ? kBRows : kBCols;
  const int64_t width = (s1 - s0) * 32;
  std::vector<float> acc(n * width, 0.0f);
  bool ahead = false;  // the next block's codes prefetched (where W's codes lie in rows along its k)
  if constexpr (Lanes::kAhead) ahead = span_bytes(dec, 0, 0, std::min(kBCols, K) - 1) >= kBackPrefetchMinRunBytes;
  for (int64_t o0 = 0; o0 < O; o0 += bR) {
    const int rows = static_cast<int>(std::min<int64_t>(bR, O - o0));
    for (int64_t k0 = s0 * 32; k0 < s1 * 32; k0 += bC) {
      const int64_t cols = std::min<int64_t>(bC, s1 * 32 - k0);  // whole 32s, past K included
      Lanes::decode_block(dec, o0, rows, k0, cols, K, w, bC * Lanes::kPair);
      // the next block (this row block's next columns, else the next row block's first), a share per 32 columns
      const bool along = k0 + bC < s1 * 32;
      const int64_t nk = along ? k0 + bC : s0 * 32, no = along ? o0 : o0 + bR;
      const int64_t next_rows = ahead && nk < K && no < O ? std::min<int64_t>(bR, O - no) : 0;
      const int64_t next_last = std::min<int64_t>({nk + bC, s1 * 32, K}) - 1;
      for (int64_t c = 0; c < cols; c += 32) {
        if constexpr (Lanes::kAhead) prefetch_share(dec, no, next_rows, nk, next_last, c / 32, cols / 32);
        for (int64_t r0 = 0; r0 < n; r0 += Lanes::kGRows)
          with_rows<Lanes::kGRows>(n - r0, [&](auto R) MOETUNE_AVX2 {
            Lanes::template backward<decltype(R)::value>(w + c * Lanes::kPair, bC * Lanes::kPair, rows,
                                                         g + r0 * ldg + o0, ldg,
                                                         acc.data() + r0 * width + (k0 + c - s0 * 32), width);
          });
      }
    }
  }
  for (int64_t s = s0; s < s1; ++s) {
    const int64_t k0 = s * 32;
    for (int q = 0; q < 4 && k0 + q * 8 < K; ++q)
      for (int64_t r = 0; r < n; ++r) {
        __m256 v = _mm256_loadu_ps(acc.data() + r * width + (k0 - s0 * 32) + q * 8);
        if (row_step) v = _mm256_mul_ps(v, _mm256_set1_ps(row_step[r]));
        store_lanes(out + r * ldo + k0 + q * 8, v, static_cast<int>(std::min<int64_t>(8, K - k0 - q * 8)),
                    accumulate);
      }
  }
}

// The loops' lanes. F32Lanes: every decoder's codes dequantized to fp32 (decode_row), FMA, a's rows as they are;
// I16Lanes: int8's codes widened to int16 against a's rows as 16-bit integers (avx2_int16.h), vpmaddwd.
struct F32Lanes {
  using W = float;  // a decoded weight
  using A = float;  // an activation
  static constexpr int kCols = 8;  // a vector's columns
  // forward: rows of x per register block: 3 x 4 accumulators + operands fit 16 ymm
  static constexpr int kRows = 3;
  // backward: rows of g per register block, 16 columns at a time: 6 x 2 accumulators, 2 weight vectors and a
  // broadcast fit 16 ymm (8 loads per 12 FMAs; 4 columns x 3 rows reloaded W per row: 2x slower at n = 64)
  static constexpr int kGRows = 6;
  static constexpr int kPair = 1;  // backward: weight rows per row of a decoded block
  static constexpr bool kAhead = true;  // backward: the next block's codes prefetched
  template <class Dec>
  MOETUNE_AVX2 static void decode(const Dec& dec, int64_t o, int64_t k0, int64_t cols, int64_t K, W* dst) {
    decode_row(dec, o, k0, cols, K, dst);
  }
  template <class Dec>
  MOETUNE_AVX2 static void decode_block(const Dec& dec, int64_t o0, int rows, int64_t k0, int64_t cols, int64_t K,
                                        W* w, int64_t ldw) {
    for (int o = 0; o < rows; ++o) decode_row(dec, o0 + o, k0, cols, K, w + o * ldw);
  }
  template <int R>
  MOETUNE_AVX2 static void forward(const W* w, const A* x, int64_t ldx, int64_t cols, float* res, const Codes& ahead) {
    const int64_t full = cols / 8 * 8;
    forward_block<R>(w, x, ldx, full, static_cast<int>(cols - full), res, ahead);
  }
  template <int R>
  MOETUNE_AVX2 static void backward(const W* w, int64_t ldw, int rows, const A* g, int64_t ldg, float* acc,
                                    int64_t lda) {
    backward_block<R>(w, ldw, rows, g, ldg, acc, lda);
  }
};

struct I16Lanes {
  using W = int16_t;
  using A = int16_t;
  static constexpr int kCols = 16;
  // forward: 2 x 4 accumulators, 2 rows of x, a weight vector and vpmaddwd's product; 3 rows (17 ymm) spill and
  // measured 0.7-0.98x of 2 (Zen 3, one product timed in a loop)
  static constexpr int kRows = 2;
  // backward: 4 x 2 accumulators, 2 weight vectors, the broadcast pair and the product; 6 rows (as F32Lanes) fit
  // 16 ymm too but measured 0.89-1.34x of the fp32 loops at 1-32 rows of g, 4 rows 0.86-1.36x and 1.21-1.36x at
  // 8-32 (Zen 3, bench/kernel_ab.py)
  static constexpr int kGRows = 4;
  static constexpr int kPair = 2;  // decode_pairs' rows hold two weight rows, interleaved
  static constexpr bool kAhead = true;
  MOETUNE_AVX2 static void decode(const moetune::Int8Rows& dec, int64_t o, int64_t k0, int64_t cols, int64_t, W* dst) {
    moetune_avx2_int16::decode_row(dec, o, k0, cols, dst);
  }
  MOETUNE_AVX2 static void decode_block(const moetune::Int8Rows& dec, int64_t o0, int rows, int64_t k0, int64_t cols,
                                        int64_t, W* w, int64_t ldw) {
    moetune_avx2_int16::decode_pairs(dec, o0, rows, k0, cols, w, ldw);
  }
  template <int R>
  MOETUNE_AVX2 static void forward(const W* w, const A* x, int64_t ldx, int64_t cols, float* res, const Codes& ahead) {
    moetune_avx2_int16::forward_block<R, kWRows>(w, kChunk, x, ldx, (cols + 15) / 16 * 16, res,
                                                  [&](int64_t i) MOETUNE_AVX2 { prefetch_ahead(ahead, i); });
  }
  template <int R>
  MOETUNE_AVX2 static void backward(const W* w, int64_t ldw, int rows, const A* g, int64_t ldg, float* acc,
                                    int64_t lda) {
    moetune_avx2_int16::backward_block<R>(w, ldw, rows, g, ldg, acc, lda);
  }
};

// W^T as the backward's weight: V[k, o] = W[o, k], V [K, O] (out[n, O] = x[n, K] @ V, backward_range's product)
template <class Dec>
struct Transposed {
  const Dec& dec;
  int64_t K;  // W's (V's rows; its columns, W's O, are backward_range's K)
};

// v[i] <- the i-th column of the 8 x 8 block v (lane j of v[i] is v[j]'s lane i)
MOETUNE_AVX2 inline void transpose8(__m256 v[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(v[i], v[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(v[i], v[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    v[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

// The forward on the backward's loops (F32Lanes' register blocks): a block of V, rows k0 .. k0 + rows (W's columns)
// by columns o0 .. o0 + cols (W's rows), decoded 8 x 8 at a time (8 of W's rows, `eight` each) and transposed in
// registers; W's rows past O and columns past K as zeros. No prefetch: V's rows are W's columns.
struct TransposedLanes : F32Lanes {
  static constexpr bool kAhead = false;
  template <class Dec>
  MOETUNE_AVX2 static void decode_block(const Transposed<Dec>& t, int64_t k0, int rows, int64_t o0, int64_t cols,
                                        int64_t O, W* w, int64_t ldw) {
    for (int64_t ob = 0; ob < cols; ob += 8)
      for (int kb = 0; kb < rows; kb += 8) {
        __m256 v[8];
        const int valid = static_cast<int>(t.K - k0 - kb);
        for (int i = 0; i < 8; ++i)
          v[i] = o0 + ob + i < O ? t.dec.eight(o0 + ob + i, k0 + kb, valid) : _mm256_setzero_ps();
        transpose8(v);
        for (int i = 0; i < 8; ++i) _mm256_store_ps(w + (kb + i) * ldw + ob, v[i]);
      }
  }
};

// fp8_block's codes as a decoder without its scales: V[o, k] = the code's value * 2^-8, exact in fp32 (half8: fp16
// bits widened), 16 at a time in a row's runs. Its products take each 128 x 128 block's mult (scale_inv * 2^8) on
// the activations instead (block_scaled, below).
struct Fp8Codes {
  const moetune::Fp8BlockRows& fp8;
  MOETUNE_AVX2 inline __m256 eight(int64_t o, int64_t k0, int valid) const {
    if (valid <= 0) return _mm256_setzero_ps();
    return _mm256_cvtph_ps(moetune::Fp8BlockRows::half8(moetune::load8(code(o, k0), valid)));
  }
  MOETUNE_AVX2 inline void span8(int64_t o, int64_t k0, int64_t cols, float* dst) const {
    const auto* p = static_cast<const int8_t*>(code(o, k0));
    int64_t c = 0;
    for (; c + 16 <= cols; c += 16) {
      const __m256i h = moetune::Fp8BlockRows::half16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + c)));
      _mm256_storeu_ps(dst + c, _mm256_cvtph_ps(_mm256_castsi256_si128(h)));
      _mm256_storeu_ps(dst + c + 8, _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)));
    }
    if (c < cols) _mm256_storeu_ps(dst + c, eight(o, k0 + c, 8));  // cols: whole 8s inside K (decode_row)
  }
  inline const void* code(int64_t o, int64_t k) const { return fp8.code(o, k); }
};

// fp8_block up to this many rows of x / g: block_scaled (below). Against the scaled decoding (bench/kernel_ab.py,
// Zen 3, one thread, three runs; noise about 5-10%): forward gate_up 1.02-1.17x and down 0.85-1.16x at 1-12 rows,
// 0.88-1.16x at 16, 0.68-0.97x at 32 (x's copies, n K per 128 rows of W, outgrow the decoding's multiplies);
// backward 0.90-1.23x at 1-24 rows (mostly above 1.05x), 0.90-1.14x at 32, 0.93-0.94x at 48-64 (docs/performance.md)
constexpr int64_t kScaledMaxRowsForward = 12, kScaledMaxRowsBackward = 32;

// dst[0 .. len) = src[0 .. len) * m
MOETUNE_AVX2 inline void scaled_run(const float* src, float* dst, int64_t len, float m) {
  const __m256 mv = _mm256_set1_ps(m);
  int64_t i = 0;
  for (; i + 8 <= len; i += 8) _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_loadu_ps(src + i), mv));
  for (; i < len; ++i) dst[i] = src[i] * m;
}

// fp8_block's products with each block's mult on the activations and the codes decoded without it (Fp8Codes: the
// decoding's multiply per weight gone, 16 codes per step). Forward: per run of 4-row blocks in one grid row, a copy
// of x with each 128-column block times that grid row's mult (n K multiplies per 128 rows of W); a block across two
// grid rows (seg not a multiple of 4) decodes with its scales. Backward: per 128 columns of K, a copy of g with each
// column o times its grid row's mult (n O multiplies per 128 columns). The sums are the scaled decoding's up to
// rounding: x * (s 2^8) * (c 2^-8) for x * (c s).
MOETUNE_AVX2 void block_scaled(bool forward, const moetune::Fp8BlockRows& dec, const float* a, int64_t lda, int64_t n,
                               int64_t K, int64_t O, float* out, int64_t ldo, bool accumulate) {
  const Fp8Codes codes{dec};
  if (forward) {
    // the grid row of block ob's rows, or -1 where they lie in two
    auto grid = [&](int64_t ob) {
      const int64_t r = dec.grid_row(ob * kWRows);
      return dec.grid_row(std::min(O, (ob + 1) * kWRows) - 1) == r ? r : -1;
    };
    at::parallel_for(0, (O + kWRows - 1) / kWRows, 1, [&](int64_t b0, int64_t b1) {
      std::vector<float> xs(n * K);
      for (int64_t ob = b0, end; ob < b1; ob = end) {
        const int64_t r = grid(ob);
        for (end = ob + 1; end < b1 && grid(end) == r;) ++end;
        if (r < 0) {
          forward_range<F32Lanes>(dec, nullptr, a, lda, nullptr, n, K, O, out, ldo, accumulate, ob, end);
          continue;
        }
        for (int64_t i = 0; i < n; ++i)
          for (int64_t k0 = 0; k0 < K; k0 += 128)
            scaled_run(a + i * lda + k0, xs.data() + i * K + k0, std::min<int64_t>(128, K - k0),
                       dec.mult(ob * kWRows, k0));
        forward_range<F32Lanes>(codes, nullptr, xs.data(), K, nullptr, n, K, O, out, ldo, accumulate, ob, end);
      }
    });
    return;
  }
  at::parallel_for(0, (K + 31) / 32, 1, [&](int64_t s0, int64_t s1) {
    std::vector<float> gs(n * O);
    for (int64_t s = s0, end; s < s1; s = end) {
      end = std::min(s1, (s / 4 + 1) * 4);  // the strips of one 128-column block
      for (int64_t o0 = 0, o1; o0 < O; o0 = o1) {  // runs of one grid row
        o1 = std::min(O, dec.grid_end(o0));
        const float m = dec.mult(o0, s * 32);
        for (int64_t i = 0; i < n; ++i) scaled_run(a + i * lda + o0, gs.data() + i * O + o0, o1 - o0, m);
      }
      backward_range<F32Lanes>(codes, gs.data(), O, nullptr, n, K, O, out, ldo, accumulate, s, end);
    }
  });
}

template <class Dec>
void run_gemm(bool forward, const Dec& dec, const float* row_scale, const torch::Tensor& a, torch::Tensor& out,
              int64_t O, int64_t K, bool accumulate) {
  const int64_t n = a.size(0);
  auto* op = out.data_ptr<float>();
  const int64_t ldo = out.stride(0);
  const auto* ap = a.data_ptr<float>();
  const int64_t lda = a.stride(0);
  if constexpr (std::is_same_v<Dec, moetune::Fp8BlockRows>) {
    if (n <= (forward ? kScaledMaxRowsForward : kScaledMaxRowsBackward))
      return block_scaled(forward, dec, ap, lda, n, K, O, op, ldo, accumulate);
  }
  if constexpr (std::is_same_v<Dec, moetune::Int8Rows>) {  // int16 rows against the codes (avx2_int16.h)
    // x's rows, or g's times the row scale (in fp32), as 16-bit integers
    const auto rows = moetune_avx2_int16::rows_q<int16_t>(ap, lda, n, forward ? K : O, forward ? nullptr : row_scale);
    const int16_t* q = rows.row(0);
    const float* step = rows.step.data();
    if (forward)
      at::parallel_for(0, (O + kWRows - 1) / kWRows, 1, [&](int64_t b0, int64_t b1) {
        forward_range<I16Lanes>(dec, row_scale, q, rows.ld, step, n, K, O, op, ldo, accumulate, b0, b1);
      });
    else
      at::parallel_for(0, (K + 31) / 32, 1, [&](int64_t s0, int64_t s1) {
        backward_range<I16Lanes>(dec, q, rows.ld, step, n, K, O, op, ldo, accumulate, s0, s1);
      });
  } else if (forward && n >= kTransposedMinRows && !row_scale) {  // out = x @ V, V = W^T: the backward's loops
    const Transposed<Dec> t{dec, K};
    at::parallel_for(0, (O + 31) / 32, 1, [&](int64_t s0, int64_t s1) {
      backward_range<TransposedLanes>(t, ap, lda, nullptr, n, O, K, op, ldo, accumulate, s0, s1);
    });
  } else if (forward) {
    at::parallel_for(0, (O + kWRows - 1) / kWRows, 1, [&](int64_t b0, int64_t b1) {
      forward_range<F32Lanes>(dec, row_scale, ap, lda, nullptr, n, K, O, op, ldo, accumulate, b0, b1);
    });
  } else {
    // g * row_scale in fp32 (the torch path's scaled gradient), else g itself
    const torch::Tensor g = row_scale ? a * torch::from_blob(const_cast<float*>(row_scale), {O}) : a;
    const auto* gp = g.data_ptr<float>();
    const int64_t ldg = g.stride(0);
    at::parallel_for(0, (K + 31) / 32, 1, [&](int64_t s0, int64_t s1) {
      backward_range<F32Lanes>(dec, gp, ldg, nullptr, n, K, O, op, ldo, accumulate, s0, s1);
    });
  }
}

// int4_gemm_a8's products (entry.h): x, or g, as 8-bit integer rows (avx2_int8.h); the backward with K / 2 not a
// multiple of 32 is int4_gemm's, g unrounded
void int4_a8(bool forward, const moetune::Int4Rows& dec, const torch::Tensor& a, torch::Tensor& out, int64_t O,
             int64_t K, bool accumulate) {
  const auto* ap = a.data_ptr<float>();
  auto* op = out.data_ptr<float>();
  if (forward)
    moetune_avx2_int8::int4_forward(dec, ap, a.stride(0), a.size(0), K, O, op, out.stride(0), accumulate);
  else if (dec.half % 32 == 0)
    moetune_avx2_int8::int4_backward(dec, ap, a.stride(0), a.size(0), K, O, op, out.stride(0), accumulate);
  else
    run_gemm(false, dec, nullptr, a, out, O, K, accumulate);
}

}  // namespace

#include "entry.h"
