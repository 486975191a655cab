// Fused quantized-weight GEMMs for moetune's expert engine: codes read from memory, dequantized in registers
// into bf16 tiles of 16 x 32 values, multiplied on AMX-BF16 tiles with fp32 accumulation.
//
//   forward : out[n, O] (+)= x[n, K] @ W^T          W = the format's dequantized [O, K] matrix
//   backward: out[n, K] (+)= g[n, O] @ W
//
// int8 (codes [O, K] int8, fp32 row scale [O]): W = diag(scale) @ codes. The codes are exact in bf16; the row
// scale is applied in fp32 to the forward's fp32 sums and to the backward's g (rounded once to bf16, as the
// torch path does). int4 (packed [O, K/2] uint8, bf16 scale [O, K/g], optional uint8 zero [O, K/g]): each
// weight (u - z) * s formed in fp32 and rounded once to bf16, as the torch path's tiles are.
//
// Layouts: AMX's tdpbf16ps computes C[16 r, 16 c] += A[16 r, 32 d] . B[16 d/2, 16 c x 2] (B pairs along d).
//   forward : C[16 o, 16 n] += W[16 o, 32 k] . X[16 k/2, 16 n x 2]: W rows are decoded straight into an A
//             tile; x is re-laid into B tiles once per call; up to 64 rows of x (4 C tiles) per pass.
//   backward: C[16 n, 16 k] += G[16 n, 32 o] . W'[16 o/2, 16 k x 2]: g (scaled) is re-laid into A tiles; W'
//             interleaves the decoded rows o and o + 1 of a 64-column strip.
// Each thread of at::parallel_for configures its own tiles (AMX state is per thread).
// The weight decoders (decoders.h) and the Python entry points (entry.h) are shared with the other variants.
#define MOETUNE_VARIANT "AMX-BF16"
#define MOETUNE_TABLES  // fp8_block by table (entry.h)

#include "decoders.h"
#include "layouts.h"

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace {

using moetune::bf16_to_float;
using moetune::decode_pairs;
using moetune::first;
using moetune::scaled_rows;
using moetune::store_row;

constexpr int kMaxBlocks = 4;  // 16-row blocks of n per pass over a panel: 4 C tiles + A + B tiles fit AMX's 8
// Software prefetch distances: forward, columns ahead in each of a block's 16 rows; backward, 32-row steps ahead
// down a strip (layouts.h). Without them the kernels waited on memory for weights not already in cache.
constexpr int64_t kAheadColumns = 512;
constexpr long kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;

#define MOETUNE_ISA "amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16"
#define MOETUNE_AMX __attribute__((target(MOETUNE_ISA)))
#define MOETUNE_AMX_LAMBDA __attribute__((target(MOETUNE_ISA)))

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Why not usable here, or "" when AMX-BF16 tiles are available to this process.
std::string variant_unavailable() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return "CPUID leaf 7 is missing";
  bool amx_bf16 = d & (1u << 22), amx_tile = d & (1u << 24);
  bool avx512 = (b & (1u << 16)) && (b & (1u << 30)) && (b & (1u << 31));  // F, BW, VL
  if (!amx_tile || !amx_bf16) return "the CPU has no AMX-BF16";
  if (!avx512) return "the CPU has no AVX512F/BW/VL";
  if (!(c & (1u << 11))) return "the CPU has no AVX512-VNNI";  // decoders.h's target
  if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !(a & (1u << 5))) return "the CPU has no AVX512-BF16";
  // Linux hands out the AMX register state only on request (once per process; oneDNN makes the same call).
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0)
    return "the kernel refused AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)";
  return "";
}

MOETUNE_AMX inline void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

// x [n, K] bf16 (row stride ldx) -> B tiles [nb][ks][16 kp][16 n][2], zero-padded to 16 rows and 32 columns.
MOETUNE_AMX void relayout_rows(const at::BFloat16* x, int64_t ldx, int64_t n, int64_t K, int64_t steps,
                               uint16_t* dst) {
  const int64_t blocks = (n + 15) / 16;
  std::memset(dst, 0, sizeof(uint16_t) * blocks * steps * 512);
  const __m512i offsets = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                             _mm512_set1_epi32(64));  // byte offset of kp rows in a tile
  for (int64_t r = 0; r < n; ++r) {
    const uint16_t* row = reinterpret_cast<const uint16_t*>(x + r * ldx);
    uint16_t* tiles = dst + (r / 16) * steps * 512 + (r % 16) * 2;
    int64_t ks = 0;
    for (; (ks + 1) * 32 <= K; ++ks) {  // 16 bf16 pairs -> column (r % 16) of 16 tile rows
      __m512i pairs = _mm512_loadu_si512(row + ks * 32);
      _mm512_i32scatter_epi32(tiles + ks * 512, offsets, pairs, 1);
    }
    for (int64_t k = ks * 32; k < K; ++k) tiles[ks * 512 + ((k - ks * 32) / 2) * 32 + (k % 2)] = row[k];
  }
}

// C tiles 0..NB-1 = sum over `steps` of the shared tile (`shared(step)`: a 16 x 64-byte tile) times NB tiles
// (each + step * each_step + nb * each_block, row stride each_ld bytes), then stored to c[nb] (16 x 16 fp32).
// Tiles: 0-3 C, 4 the shared operand (forward: A = W rows; backward: B = W' pairs), 5-7 the other one.
template <int NB, bool A_SHARED, class Shared>
MOETUNE_AMX inline void tile_products(const Shared& shared, const uint16_t* each, int64_t each_step, int64_t each_ld,
                                      int64_t each_block, int64_t steps, float (*c)[256]) {
  _tile_zero(0);
  if (NB > 1) _tile_zero(1);
  if (NB > 2) _tile_zero(2);
  if (NB > 3) _tile_zero(3);
  // forward: C[o, n] += A(W, shared) . B(x, each); backward: C[n, k] += A(g, each) . B(W', shared)
#define MOETUNE_DP(C, T) \
  if (A_SHARED) {        \
    _tile_dpbf16ps(C, 4, T); \
  } else {               \
    _tile_dpbf16ps(C, T, 4); \
  }
  for (int64_t st = 0; st < steps; ++st) {
    _tile_loadd(4, shared(st), 64);
    const uint16_t* e = each + st * each_step;
    _tile_loadd(5, e, each_ld);
    MOETUNE_DP(0, 5)
    if (NB > 1) {
      _tile_loadd(6, e + each_block, each_ld);
      MOETUNE_DP(1, 6)
    }
    if (NB > 2) {
      _tile_loadd(7, e + 2 * each_block, each_ld);
      MOETUNE_DP(2, 7)
    }
    if (NB > 3) {
      _tile_loadd(5, e + 3 * each_block, each_ld);
      MOETUNE_DP(3, 5)
    }
  }
#undef MOETUNE_DP
  _tile_stored(0, c[0], 64);
  if (NB > 1) _tile_stored(1, c[NB > 1 ? 1 : 0], 64);
  if (NB > 2) _tile_stored(2, c[NB > 2 ? 2 : 0], 64);
  if (NB > 3) _tile_stored(3, c[NB > 3 ? 3 : 0], 64);
}

template <bool A_SHARED, class Shared>
MOETUNE_AMX inline void tile_products_n(int nb, const Shared& shared, const uint16_t* each, int64_t each_step,
                                        int64_t each_ld, int64_t each_block, int64_t steps, float (*c)[256]) {
  switch (nb) {
    case 1: tile_products<1, A_SHARED>(shared, each, each_step, each_ld, each_block, steps, c); break;
    case 2: tile_products<2, A_SHARED>(shared, each, each_step, each_ld, each_block, steps, c); break;
    case 3: tile_products<3, A_SHARED>(shared, each, each_step, each_ld, each_block, steps, c); break;
    default: tile_products<4, A_SHARED>(shared, each, each_step, each_ld, each_block, steps, c); break;
  }
}

// Forward, output columns (weight rows) [16 ob0, 16 ob1), for every 64-row chunk of x: each step decodes
// 16 rows x 32 codes into an A tile in L1 and multiplies it with the chunk's B tiles. (Decoding a block's
// whole K into a panel first, once for all chunks, measured slower up to n = 256: 0.96 vs 0.61 ms per
// [1536, 2048] int8 matrix at n = 64, as the panel's reloads come from L2; a block's codes stay in cache
// between chunks, so decoding them again is cheap.)
// (a lambda does not inherit a function's target attributes: each thread's share is its own function)
template <class Dec>
MOETUNE_AMX void forward_range(const Dec& dec, const float* row_scale, const uint16_t* xt, int64_t n, int64_t K,
                               int64_t O, at::BFloat16* out, int64_t ldo, bool accumulate, int64_t ob0,
                               int64_t ob1) {
  const int64_t steps = (K + 31) / 32, blocks = (n + 15) / 16;
  configure_tiles();
  alignas(64) uint16_t a[16 * 32];
  alignas(64) float c[kMaxBlocks][256];
  const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(16));
  for (int64_t ob = ob0; ob < ob1; ++ob) {
    const int64_t o0 = ob * 16;
    const int rows = static_cast<int>(std::min<int64_t>(16, O - o0));
    auto decode = [&](int64_t ks) MOETUNE_AMX_LAMBDA {
      const int64_t k0 = ks * 32;
      if (ks % 2 == 0 && k0 + kAheadColumns < K)  // one 64-byte line of int8 codes per two steps
        for (int r = 0; r < rows; ++r) moetune::prefetch<_MM_HINT_T0>(dec, o0 + r, k0 + kAheadColumns);
      for (int r = 0; r < 16; ++r) {
        __m512bh w = r < rows ? _mm512_cvtne2ps_pbh(dec(o0 + r, k0 + 16, static_cast<int>(K - k0 - 16)),
                                                    dec(o0 + r, k0, static_cast<int>(K - k0)))
                              : (__m512bh)_mm512_setzero_si512();
        _mm512_store_si512(a + r * 32, (__m512i)w);
      }
      return static_cast<const uint16_t*>(a);
    };
    const __mmask16 m = first(rows);
    const __m512 scale = row_scale ? _mm512_maskz_loadu_ps(m, row_scale + o0) : _mm512_set1_ps(1.0f);
    for (int64_t b0 = 0; b0 < blocks; b0 += kMaxBlocks) {
      const int nb = static_cast<int>(std::min<int64_t>(kMaxBlocks, blocks - b0));
      tile_products_n<true>(nb, decode, xt + b0 * steps * 512, 512, 64, steps * 512, steps, c);
      for (int64_t r = b0 * 16; r < std::min<int64_t>(n, (b0 + nb) * 16); ++r) {  // c[nb][o][n] -> out[n, o]
        __m512 v = _mm512_i32gather_ps(column, c[(r - b0 * 16) / 16] + (r % 16), 4);
        store_row(out + r * ldo + o0, _mm512_mul_ps(v, scale), m, accumulate);
      }
    }
  }
  _tile_release();
}

// Backward with at most 16 rows of g: the four 16-column tiles of a 64-column panel each have their own C tile,
// so each step's W' tiles are decoded into L1 and used at once (no panel written to memory and read back:
// 0.59 -> 0.39 ms per [1536, 2048] int8 matrix at n = 8, one thread).
template <class Dec>
MOETUNE_AMX void backward_one_block(const Dec& dec, const uint16_t* gt, int64_t opad, int64_t n, int64_t K,
                                    int64_t O, at::BFloat16* out, int64_t ldo, bool accumulate, int64_t s0,
                                    int64_t s1) {
  const int64_t steps = opad / 32;
  configure_tiles();
  alignas(64) uint16_t bt[4][512];
  alignas(64) float c[256];
  for (int64_t s = s0; s < s1; ++s) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t os = 0; os < steps; ++os) {
      decode_pairs<_MM_HINT_T0>(dec, os, s, K, O, bt[0], 512);
      _tile_loadd(5, gt + os * 512, 64);
      _tile_loadd(4, bt[0], 64);
      _tile_dpbf16ps(0, 5, 4);
      _tile_loadd(6, bt[1], 64);
      _tile_dpbf16ps(1, 5, 6);
      _tile_loadd(7, bt[2], 64);
      _tile_dpbf16ps(2, 5, 7);
      _tile_loadd(4, bt[3], 64);
      _tile_dpbf16ps(3, 5, 4);
    }
    for (int q = 0; q < 4 && s * 64 + q * 16 < K; ++q) {
      const int64_t k0 = s * 64 + q * 16;
      switch (q) {
        case 0: _tile_stored(0, c, 64); break;
        case 1: _tile_stored(1, c, 64); break;
        case 2: _tile_stored(2, c, 64); break;
        default: _tile_stored(3, c, 64); break;
      }
      const __mmask16 m = first(static_cast<int>(K - k0));
      for (int64_t r = 0; r < n; ++r) store_row(out + r * ldo + k0, _mm512_load_ps(c + r * 16), m, accumulate);
    }
  }
  _tile_release();
}

// Backward, output columns [64 s0, 64 s1) a panel of 64 at a time: the panel's W' tiles (all of O) are decoded
// once into per-thread memory, each row's 64 codes in one go, then multiplied 16 columns at a time with every
// 64-row chunk of g. (Decoding 16 columns per step instead read each cache line four times, and rows K bytes
// apart collide in the caches' sets: int8 with K = 2048 took 1.2 ms per [1536, 2048] matrix at n = 8, int4 with
// its 1024-byte rows 0.75 ms; one panel decode per line: 0.48 ms.)
template <class Dec>
MOETUNE_AMX void backward_range(const Dec& dec, const uint16_t* gt, int64_t opad, int64_t n, int64_t K, int64_t O,
                                at::BFloat16* out, int64_t ldo, bool accumulate, int64_t s0, int64_t s1) {
  const int64_t steps = opad / 32, blocks = (n + 15) / 16;
  configure_tiles();
  std::vector<uint16_t> panel(steps * 4 * 512);  // [q][os][16 pairs of o][16 k x 2]
  alignas(64) float c[kMaxBlocks][256];
  for (int64_t s = s0; s < s1; ++s) {
    for (int64_t os = 0; os < steps; ++os)
      decode_pairs<_MM_HINT_T0>(dec, os, s, K, O, panel.data() + os * 512, steps * 512);
    for (int q = 0; q < 4 && s * 64 + q * 16 < K; ++q) {
      const int64_t k0 = s * 64 + q * 16;
      const __mmask16 m = first(static_cast<int>(K - k0));
      for (int64_t b0 = 0; b0 < blocks; b0 += kMaxBlocks) {
        const int nb = static_cast<int>(std::min<int64_t>(kMaxBlocks, blocks - b0));
        const uint16_t* strip = panel.data() + q * steps * 512;
        auto tiles = [strip](int64_t os) { return strip + os * 512; };
        tile_products_n<false>(nb, tiles, gt + b0 * steps * 512, 512, 64, steps * 512, steps, c);
        for (int64_t r = b0 * 16; r < std::min<int64_t>(n, (b0 + nb) * 16); ++r)
          store_row(out + r * ldo + k0, _mm512_load_ps(c[(r - b0 * 16) / 16] + (r % 16) * 16), m, accumulate);
      }
    }
  }
  _tile_release();
}

template <class Dec>
void run_gemm(bool forward, const Dec& dec, const float* row_scale, const torch::Tensor& a, torch::Tensor& out,
              int64_t O, int64_t K, bool accumulate) {
  const int64_t n = a.size(0), padded = (n + 15) / 16 * 16;
  const auto* ap = a.data_ptr<at::BFloat16>();
  auto* op = out.data_ptr<at::BFloat16>();
  const int64_t lda = a.stride(0), ldo = out.stride(0);
  const int64_t steps = (K + 31) / 32, opad = (O + 31) / 32 * 32;
  std::vector<uint16_t> operand(forward ? padded * steps * 32 : padded * opad);  // x's B tiles or g's A rows
  if (forward) {
    relayout_rows(ap, lda, n, K, steps, operand.data());
    at::parallel_for(0, (O + 15) / 16, 1, [&](int64_t b0, int64_t b1) {
      forward_range(dec, row_scale, operand.data(), n, K, O, op, ldo, accumulate, b0, b1);
    });
  } else {
    scaled_rows(ap, lda, n, O, opad, row_scale, operand.data());
    at::parallel_for(0, (K + 63) / 64, 1, [&](int64_t s0, int64_t s1) {
      if (n <= 16)
        backward_one_block(dec, operand.data(), opad, n, K, O, op, ldo, accumulate, s0, s1);
      else
        backward_range(dec, operand.data(), opad, n, K, O, op, ldo, accumulate, s0, s1);
    });
  }
}

}  // namespace

#include "entry.h"
