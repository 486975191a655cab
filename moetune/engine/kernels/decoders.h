// Weight decoders shared by every kernel variant: each turns a format's stored codes into fp32 values of the
// dequantized matrix W [O, K], 16 columns at a time, in registers.
//
// Contract (a later format adds one struct with these two members, and an entry point in entry.h):
//   __m512 operator()(int64_t o, int64_t k0, int valid) const
//       the 16 fp32 values W[o, k0 .. k0 + 16) (k0 % 16 == 0), lanes at and past `valid` zero (valid may be
//       <= 0 or >= 16); each value is exactly the one the format's torch path multiplies with (int8: the code,
//       its row scale applied by the caller; int4: (u - z) * s in fp32, rounded to bf16 by the caller).
//   void prefetch(int64_t o, int64_t k) const
//       bring the cache line holding W[o, k]'s codes towards L1 (k < K); no effect on results.
// Compiled for AVX512F/BW/VL (+BF16) through target attributes, so a variant compiled with other flags (the
// AMX one adds amx-tile/amx-bf16) inlines them into its own target-attributed loops.
#pragma once

#include <torch/extension.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#define MOETUNE_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

namespace moetune {

// the first `valid` of 16 lanes (none for valid <= 0, all for valid >= 16)
MOETUNE_AVX512 inline __mmask16 first(int valid) {
  return valid >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (valid > 0 ? valid : 0)) - 1u);
}

MOETUNE_AVX512 inline float bf16_to_float(const at::BFloat16 v) {
  uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// int8: codes [O, K] int8; W = diag(row scale) @ codes, the scale applied by the caller (exact codes here).
struct Int8Rows {
  const int8_t* codes;  // [O, K]
  int64_t K;
  MOETUNE_AVX512 inline __m512 operator()(int64_t o, int64_t k0, int valid) const {
    __m128i b = _mm_maskz_loadu_epi8(first(valid), codes + o * K + k0);
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
  }
  inline void prefetch(int64_t o, int64_t k) const {
    _mm_prefetch(reinterpret_cast<const char*>(codes + o * K + k), _MM_HINT_T0);
  }
};

// int4: W[o, k] = (u - z) * s with u the 4-bit code, z the group's zero point (8 when symmetric), s its bf16 scale.
struct Int4Rows {
  const uint8_t* packed;  // [O, K/2]: byte j holds u[j] (low nibble) and u[j + K/2] (high nibble)
  const at::BFloat16* scale;  // [O, K/g]
  const uint8_t* zero;  // [O, K/g] or null (symmetric: z = 8)
  int64_t half, groups;  // K/2, K/g
  int shift;  // log2(g): g is a power of two (32, 64, 128), so no division per call
  MOETUNE_AVX512 inline __m512 operator()(int64_t o, int64_t k0, int valid) const {
    const bool high = k0 >= half;  // K/2 is a multiple of 16 (g >= 32 divides K), so no chunk straddles
    __mmask16 m = first(valid);
    __m512i u = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, packed + o * half + (high ? k0 - half : k0)));
    u = high ? _mm512_srli_epi32(u, 4) : _mm512_and_si512(u, _mm512_set1_epi32(0x0F));
    const int64_t gi = o * groups + (k0 >> shift);
    const int z = zero ? zero[gi] : 8;
    __m512 w = _mm512_cvtepi32_ps(_mm512_sub_epi32(u, _mm512_set1_epi32(z)));
    return _mm512_maskz_mul_ps(m, w, _mm512_set1_ps(bf16_to_float(scale[gi])));
  }
  inline void prefetch(int64_t o, int64_t k) const {
    _mm_prefetch(reinterpret_cast<const char*>(packed + o * half + (k >= half ? k - half : k)), _MM_HINT_T0);
  }
};

}  // namespace moetune
