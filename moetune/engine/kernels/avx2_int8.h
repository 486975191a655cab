// int4 weights against 8-bit integer activations on AVX2 (the int4 format's opt-in int8_activations on CPUs without
// AVX512: entry.h's int4_gemm_a8 on the AVX2 variant). vpmaddubsw multiplies 32 unsigned bytes by 32 signed bytes
// and adds adjacent pairs into 16 int16 lanes: 32 multiply-adds an instruction where FMA does 8 and avx2_int16.h's
// vpmaddwd 16, and a code only needs its nibble masked out (one instruction per 32 codes, no conversion).
//
//   the rows: avx2_int16.h's rounding with qmax 127 (rows_q<int8_t>): each row r of x as q[r, k] = round(x[r, k] *
//             inv_r), step_r = max_k |x[r, k]| / 127, so x[r, k] ~ step_r q[r, k] within half a step (1/254 of the
//             row's largest magnitude, int8_rows.h's precision); a row with a nan or an infinity gets step nan.
//   forward : out[r, o] (+)= step_r sum_g s[o, g] (sum_{k in g} q[r, k] u[o, k] - z[o, g] sx[r, g]), sx[r, g] the
//             group's sum of q (decoders.h's Int4Rows: W[o, k] = s[o, g] (u[o, k] - z[o, g])); lanes along k, 32
//             columns a step (the codes unsigned, 0 .. 15, q signed: vpmaddubsw's operands as they are); a group's
//             int16 lanes (at most 2 * 15 * 127 a step, 4 steps in a group of 128: 15240 < 2^15) widened to int32
//             (vpmaddwd by ones), to fp32 and times the group's scale once per group; the z terms as one fp32 dot
//             product over the groups per row of x and weight row. A weight row's codes are read once per 4 rows of
//             x from L1 (blocks of kOBlock weight rows against each 4 rows of x in turn).
//   backward: out[r, k] (+)= step_rg (sum_o q_g[r, o] u[o, k] - sum_o q_g[r, o] z[o, g]) for k in group g, q_g and
//             step_rg row r of g times the group's scales s[., g] as 8-bit rows (int8_rows.h's backward: each
//             group's own); lanes along k, four weight rows' codes interleaved per 32-bit lane (quads: vpmaddubsw
//             adds rows o, o + 1 and o + 2, o + 3 into two int16 lanes, vpmaddwd by ones both into the column's
//             int32), g's four values q_g[r, o .. o + 4) broadcast. A thread walks 32 packed bytes of every weight
//             row at a time (columns j .. j + 32 from the low nibbles, K / 2 + j .. from the high ones: each byte
//             read once), in bands of kBandQuads quads staged in L1 once for all rows of g; int16 lanes sum at most
//             8 quads (8 * 2 * 15 * 127 < 2^15), then go to int32 (at most 15 * 127 O: exact for any O below 10^6),
//             converted once per column. Needs K / 2 a multiple of 32 (int4_gemm_a8 takes the fp32 loops'
//             backward otherwise, g unrounded).
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "avx2_int16.h"
#include "decoders.h"

namespace moetune_avx2_int8 {

constexpr int kRows = 4;  // rows of x per register block: 4 fp32 sums and 4 int16 group sums in registers
// weight rows per block: 16 rows' codes (16 KiB at K = 2048) stay in L1 while every block of 4 rows of x runs
constexpr int64_t kOBlock = 16;

// The 32 codes u[o, k .. k + 32) as bytes (k a multiple of 32): the low nibbles of the row's bytes below K / 2, the
// high ones from K / 2 on (a chunk across K / 2, where K / 2 is 16 past a multiple of 32: 16 of each)
MOETUNE_AVX2 MOETUNE_ALWAYS_INLINE __m256i codes32(const moetune::Int4Rows& dec, const uint8_t* row, int64_t k) {
  const __m256i nib = _mm256_set1_epi8(0x0F);
  const int64_t half = dec.half;
  if (k + 32 <= half) return _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k)), nib);
  if (k >= half)
    return _mm256_and_si256(
        _mm256_srli_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k - half)), 4), nib);
  const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k));
  const __m128i hi = _mm_srli_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row)), 4);
  return _mm256_and_si256(_mm256_set_m128i(hi, lo), nib);
}

// res[r] = sum_g s[o, g] (sum_{k in g} q[r, k] u[o, k] - z[o, g] sx[r, g]) for r < R: x's rows (int8) ldx apart,
// sx's (fp32, ldg apart, zeros past the groups) and sz[g] = s[o, g] z[o, g] (fp32, ldg values); kSteps = group / 32
template <int R, int kSteps>
MOETUNE_AVX2 void int4_rows(const moetune::Int4Rows& dec, int64_t o, const int8_t* x, int64_t ldx, const float* sx,
                            const float* sz, int64_t ldg, float* res) {
  const uint8_t* row = dec.packed + o * dec.half;
  const at::BFloat16* scale = dec.scale + o * dec.groups;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t gi = 0; gi < dec.groups; ++gi) {
    const int64_t k0 = gi * 32 * kSteps;
    __m256i sum[R];
    for (int i = 0; i < kSteps; ++i) {
      const __m256i u = codes32(dec, row, k0 + 32 * i);
      for (int r = 0; r < R; ++r) {
        const auto* xr = reinterpret_cast<const __m256i*>(x + r * ldx + k0 + 32 * i);
        const __m256i p = _mm256_maddubs_epi16(u, _mm256_load_si256(xr));
        sum[r] = i == 0 ? p : _mm256_add_epi16(sum[r], p);
      }
    }
    const __m256 s = _mm256_set1_ps(moetune::bf16_to_float(scale[gi]));
    for (int r = 0; r < R; ++r)
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(sum[r], ones)), s, acc[r]);
  }
  for (int64_t g = 0; g < ldg; g += 8) {
    const __m256 z = _mm256_loadu_ps(sz + g);
    for (int r = 0; r < R; ++r) acc[r] = _mm256_fnmadd_ps(z, _mm256_loadu_ps(sx + r * ldg + g), acc[r]);
  }
  for (int r = 0; r < R; ++r) res[r] = moetune_avx2_int16::hsum(acc[r]);
}

// sz[g] = s[o, g] z[o, g] for g < groups (fp32), 8 groups at a time
MOETUNE_AVX2 inline void scales_times_zeros(const moetune::Int4Rows& dec, int64_t o, float* sz) {
  const int64_t at = o * dec.groups;
  int64_t g = 0;
  for (; g + 8 <= dec.groups; g += 8) {
    const __m256i bits = _mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dec.scale + at + g))), 16);
    const __m256 z = dec.zero ? _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                    _mm_loadl_epi64(reinterpret_cast<const __m128i*>(dec.zero + at + g))))
                              : _mm256_set1_ps(8.0f);
    _mm256_storeu_ps(sz + g, _mm256_mul_ps(_mm256_castsi256_ps(bits), z));
  }
  for (; g < dec.groups; ++g) sz[g] = moetune::bf16_to_float(dec.scale[at + g]) * dec.zero_point(at + g);
}

// out[n, O] (+)= x[n, K] @ W^T for int4 W, the header's forward (x and out fp32)
MOETUNE_AVX2 inline void int4_forward(const moetune::Int4Rows& dec, const float* x, int64_t ldx, int64_t n, int64_t K,
                                      int64_t O, float* out, int64_t ldo, bool accumulate) {
  const auto xq = moetune_avx2_int16::rows_q<int8_t>(x, ldx, n, K, nullptr);
  const int64_t groups = dec.groups, ldg = (groups + 7) / 8 * 8, group = K / groups;
  std::vector<float> sx(n * ldg, 0.0f);  // each row's group sums of q, fp32
  for (int64_t r = 0; r < n; ++r) {
    const int8_t* q = xq.row(r);
    for (int64_t g = 0; g < groups; ++g) {
      int32_t t = 0;
      for (int64_t k = g * group; k < (g + 1) * group; ++k) t += q[k];
      sx[r * ldg + g] = static_cast<float>(t);
    }
  }
  at::parallel_for(0, (O + kOBlock - 1) / kOBlock, 1, [&](int64_t b0, int64_t b1) MOETUNE_AVX2 {
    std::vector<float> sz(kOBlock * ldg, 0.0f);  // the block's s z per group
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t o0 = b * kOBlock, o1 = std::min(O, o0 + kOBlock);
      for (int64_t o = o0; o < o1; ++o) scales_times_zeros(dec, o, sz.data() + (o - o0) * ldg);
      for (int64_t r0 = 0; r0 < n; r0 += kRows) {
        const int64_t rows = std::min<int64_t>(kRows, n - r0);
        for (int64_t o = o0; o < o1; ++o) {
          float res[kRows];
          auto run = [&](auto R) MOETUNE_AVX2 {
            constexpr int kR = decltype(R)::value;
            auto steps = [&](auto S) MOETUNE_AVX2 {
              int4_rows<kR, decltype(S)::value>(dec, o, xq.row(r0), xq.ld, sx.data() + r0 * ldg,
                                                sz.data() + (o - o0) * ldg, ldg, res);
            };
            switch (group) {
              case 32: steps(std::integral_constant<int, 1>{}); break;
              case 64: steps(std::integral_constant<int, 2>{}); break;
              default: steps(std::integral_constant<int, 4>{}); break;  // 128 (int4_gemm_a8 checks)
            }
          };
          moetune_avx2_int16::with_rows<kRows>(rows, run);
          for (int64_t r = 0; r < rows; ++r) {
            float& dst = out[(r0 + r) * ldo + o];
            const float v = xq.step[r0 + r] * res[r];
            dst = accumulate ? dst + v : v;
          }
        }
      }
    }
  });
}

// ---- backward ----

constexpr int kBandQuads = 16;  // quads of weight rows staged per band: 64 rows x 64 columns, 4 KiB of L1
constexpr int kGRows = 2;  // rows of g per register block: 2 x 4 int16 sums, the band's 4 vectors a quad

// Row r of g times group gi's scales as 8-bit rows (q, step), and zt[r] = sum_o q[r, o] z[o, gi]
struct GroupRows {
  int64_t gi = -1;
  moetune_avx2_int16::IntRows<int8_t> q;
  std::vector<int32_t> zt;
};

// sum_o q[o] z[o] over a row of ld values (whole vectors: q zero past O), z unsigned bytes
MOETUNE_AVX2 inline int32_t dot_u8(const int8_t* q, const uint8_t* z, int64_t ld) {
  __m256i t = _mm256_setzero_si256();
  for (int64_t o = 0; o < ld; o += 32) {  // int16 pairs of at most 2 * 15 * 127, widened at once
    const __m256i p = _mm256_maddubs_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(z + o)),
                                           _mm256_load_si256(reinterpret_cast<const __m256i*>(q + o)));
    t = _mm256_add_epi32(t, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
  }
  __m128i h = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
  return _mm_cvtsi128_si32(h);
}

// GroupRows for group gi of g [n, O] (ldg apart); col, zcol: scratch (the group's scales, fp32, O values; its zero
// points, a row of the rows' ld, zeros past O)
MOETUNE_AVX2 inline void group_rows(const moetune::Int4Rows& dec, int64_t gi, const float* g, int64_t ldg, int64_t n,
                                    int64_t O, std::vector<float>& col, std::vector<uint8_t>& zcol, GroupRows& out) {
  for (int64_t o = 0; o < O; ++o) col[o] = moetune::bf16_to_float(dec.scale[o * dec.groups + gi]);
  out.gi = gi;
  out.q = moetune_avx2_int16::rows_q<int8_t>(g, ldg, n, O, col.data());
  zcol.assign(out.q.ld, 0);
  for (int64_t o = 0; o < O; ++o) zcol[o] = static_cast<uint8_t>(dec.zero_point(o * dec.groups + gi));
  out.zt.resize(n);
  for (int64_t r = 0; r < n; ++r) out.zt[r] = dot_u8(out.q.row(r), zcol.data(), out.q.ld);
}

// Weight rows o0 .. o0 + 4 nq (zeros past O), packed bytes [j0, j0 + 32), as quads: lo[4 q + v] the low nibbles,
// hi[4 q + v] the high ones, lane 4 L + i of v holding rows 4 q .. 4 q + 4's codes of column 16 L + 4 v + i (from
// j0, or K / 2 + j0); the rows a band below prefetched
MOETUNE_AVX2 inline void stage(const moetune::Int4Rows& dec, int64_t O, int64_t o0, int nq, int64_t j0, __m256i* lo,
                               __m256i* hi) {
  const __m256i nib = _mm256_set1_epi8(0x0F);
  for (int q = 0; q < nq; ++q) {
    __m256i w[4];
    for (int i = 0; i < 4; ++i) {
      const int64_t o = o0 + 4 * q + i;
      const uint8_t* p = dec.packed + o * dec.half + j0;
      w[i] = o < O ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)) : _mm256_setzero_si256();
      if (o + 4 * kBandQuads < O)
        _mm_prefetch(reinterpret_cast<const char*>(p + 4 * kBandQuads * dec.half), _MM_HINT_T0);
    }
    const __m256i ab0 = _mm256_unpacklo_epi8(w[0], w[1]), ab1 = _mm256_unpackhi_epi8(w[0], w[1]);
    const __m256i cd0 = _mm256_unpacklo_epi8(w[2], w[3]), cd1 = _mm256_unpackhi_epi8(w[2], w[3]);
    const __m256i v[4] = {_mm256_unpacklo_epi16(ab0, cd0), _mm256_unpackhi_epi16(ab0, cd0),
                          _mm256_unpacklo_epi16(ab1, cd1), _mm256_unpackhi_epi16(ab1, cd1)};
    for (int j = 0; j < 4; ++j) {
      lo[4 * q + j] = _mm256_and_si256(v[j], nib);
      hi[4 * q + j] = _mm256_and_si256(_mm256_srli_epi16(v[j], 4), nib);
    }
  }
}

// acc[r * 32 + 8 v + lane] += sum_q q[r, 4 q .. 4 q + 4) . w[4 q + v] for r < R, q < nq: q's row r at q + r * ldq
// (already at the band's first row), acc in the quads' column order
template <int R>
MOETUNE_AVX2 void band_rows(const __m256i* w, int nq, const int8_t* q, int64_t ldq, int32_t* acc) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int q0 = 0; q0 < nq; q0 += 8) {
    const int q1 = std::min(nq, q0 + 8);
    __m256i sum[R][4];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < 4; ++v) sum[r][v] = _mm256_setzero_si256();
    for (int j = q0; j < q1; ++j) {
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, q + r * ldq + 4 * j, sizeof four);
        const __m256i b = _mm256_set1_epi32(four);
        for (int v = 0; v < 4; ++v) sum[r][v] = _mm256_add_epi16(sum[r][v], _mm256_maddubs_epi16(w[4 * j + v], b));
      }
    }
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < 4; ++v) {
        auto* dst = reinterpret_cast<__m256i*>(acc + r * 32 + 8 * v);
        _mm256_storeu_si256(dst, _mm256_add_epi32(_mm256_loadu_si256(dst), _mm256_madd_epi16(sum[r][v], ones)));
      }
  }
}

// out[r, k0 .. k0 + 32) (+)= step * (acc[r] - zt) in column order (acc in the quads')
MOETUNE_AVX2 inline void store32(const int32_t* acc, int32_t zt, float step, float* dst, bool accumulate) {
  __m256 v[4];
  for (int j = 0; j < 4; ++j)
    v[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(
                             _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc + 8 * j)), _mm256_set1_epi32(zt))),
                         _mm256_set1_ps(step));
  // v[j] holds columns 4 j .. 4 j + 4 (low half) and 16 + 4 j .. (high half)
  const __m256 c[4] = {_mm256_permute2f128_ps(v[0], v[1], 0x20), _mm256_permute2f128_ps(v[2], v[3], 0x20),
                       _mm256_permute2f128_ps(v[0], v[1], 0x31), _mm256_permute2f128_ps(v[2], v[3], 0x31)};
  for (int j = 0; j < 4; ++j)
    _mm256_storeu_ps(dst + 8 * j, accumulate ? _mm256_add_ps(_mm256_loadu_ps(dst + 8 * j), c[j]) : c[j]);
}

// out[n, K] (+)= g[n, O] @ W for int4 W, the header's backward (g and out fp32; K / 2 a multiple of 32)
MOETUNE_AVX2 inline void int4_backward(const moetune::Int4Rows& dec, const float* g, int64_t ldg, int64_t n,
                                       int64_t K, int64_t O, float* out, int64_t ldo, bool accumulate) {
  const int64_t half = dec.half;
  at::parallel_for(0, half / 32, 1, [&](int64_t u0, int64_t u1) MOETUNE_AVX2 {
    std::vector<float> col(O);
    std::vector<uint8_t> zcol;
    GroupRows cache[2];  // the groups of the last unit's two halves, kept for the next units in the same groups
    auto rows_of = [&](int64_t gi, int64_t keep) -> const GroupRows& {
      for (auto& c : cache)
        if (c.gi == gi) return c;
      GroupRows& slot = cache[0].gi == keep ? cache[1] : cache[0];
      group_rows(dec, gi, g, ldg, n, O, col, zcol, slot);
      return slot;
    };
    std::vector<__m256i> lo(4 * kBandQuads), hi(4 * kBandQuads);
    std::vector<int32_t> acc_lo(n * 32), acc_hi(n * 32);
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t j0 = u * 32, glo = j0 >> dec.shift, ghi = (half + j0) >> dec.shift;
      const GroupRows& rlo = rows_of(glo, ghi);
      const GroupRows& rhi = rows_of(ghi, glo);
      std::fill(acc_lo.begin(), acc_lo.end(), 0);
      std::fill(acc_hi.begin(), acc_hi.end(), 0);
      for (int64_t o0 = 0; o0 < O; o0 += 4 * kBandQuads) {
        const int nq = static_cast<int>(std::min<int64_t>(kBandQuads, (O - o0 + 3) / 4));
        stage(dec, O, o0, nq, j0, lo.data(), hi.data());
        for (int64_t r0 = 0; r0 < n; r0 += kGRows) {
          auto run = [&](auto R) MOETUNE_AVX2 {
            band_rows<decltype(R)::value>(lo.data(), nq, rlo.q.row(r0) + o0, rlo.q.ld, acc_lo.data() + r0 * 32);
            band_rows<decltype(R)::value>(hi.data(), nq, rhi.q.row(r0) + o0, rhi.q.ld, acc_hi.data() + r0 * 32);
          };
          moetune_avx2_int16::with_rows<kGRows>(n - r0, run);
        }
      }
      for (int64_t r = 0; r < n; ++r) {
        store32(acc_lo.data() + r * 32, rlo.zt[r], rlo.q.step[r], out + r * ldo + j0, accumulate);
        store32(acc_hi.data() + r * 32, rhi.zt[r], rhi.q.step[r], out + r * ldo + half + j0, accumulate);
      }
    }
  });
}

}  // namespace moetune_avx2_int8
