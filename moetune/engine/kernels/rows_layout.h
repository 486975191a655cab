// The activation rows the integer kernels take (x, or g times scales, as 8- or 16-bit integers per row: the AVX512
// variant's int16_rows.h and int8_rows.h, the AVX2 variant's avx2_int16.h and avx2_int8.h): their layout and their
// spread over threads, with no ISA of their own; each ISA's header rounds the values into them.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace moetune_rows {

// values per thread's share at least where rows are filled over threads (a share smaller than this costs more to hand
// out than it saves)
constexpr int64_t kRowsGrainValues = 16384;

// n rows of integers of T (int16 or int8): q [n, ld] (ld >= cols, whole lines; zeros past cols), each row's step (the
// value of one integer step) and, where its header fills it, the row's integers summed exactly
template <class T>
struct IntRows {
  std::vector<T> q;
  std::vector<float> step;
  std::vector<int32_t> sum;
  int64_t ld = 0, at = 0;  // row r at q.data() + at + r * ld, aligned to the layout's line
  T* row(int64_t r) { return q.data() + at + r * ld; }
  const T* row(int64_t r) const { return q.data() + at + r * ld; }
};

// IntRows of n rows of cols values, zeros: ld cols rounded up to whole lines of line_bytes (the ISA's vector or cache
// line), one line more where rows would lie 4 KiB apart (they would share one L1 set: without it the AVX512 int16
// forward at K = 2048 measured 0.97-1.01x, within noise, at 4-64 rows of x), row 0 aligned to a line; step and sum
// of n values
template <class T>
IntRows<T> int_rows_layout(int64_t n, int64_t cols, int64_t line_bytes) {
  const int64_t line = line_bytes / static_cast<int64_t>(sizeof(T));  // values per line
  IntRows<T> rows;
  rows.ld = (cols + line - 1) / line * line;
  if (rows.ld * static_cast<int64_t>(sizeof(T)) % 4096 == 0) rows.ld += line;
  rows.q.assign(n * rows.ld + line, 0);  // + a line: room to align the rows
  rows.at = (line - reinterpret_cast<uintptr_t>(rows.q.data()) / sizeof(T) % line) % line;
  rows.step.resize(n);
  rows.sum.resize(n);
  return rows;
}

// fill(r) for each of n rows of cols values, spread over the threads (on many cores a serial pass over the activations
// would bound the product's scaling); inside a parallel region, on the calling thread
template <class F>
void each_row(int64_t n, int64_t cols, F&& fill) {
  at::parallel_for(0, n, std::max<int64_t>(1, kRowsGrainValues / std::max<int64_t>(cols, 1)),
                   [&](int64_t r0, int64_t r1) {
                     for (int64_t r = r0; r < r1; ++r) fill(r);
                   });
}

// rows per block of block_rows: the AVX512 register blocks' rows of x or g
constexpr int64_t kBlockRows = 8;

// src's n rows (ld bytes apart) as the register blocks read them, into dst: blocks of up to kBlockRows rows (block
// r0: R = min(kBlockRows, n - r0) rows, from r0 * units * Unit bytes), unit c of its row r (the Unit bytes from
// c * Unit) at (c R + r) * Unit bytes in it. One pointer and constant offsets then reach a step's R rows: with a
// pointer per row GCC 12 ran out of general registers in those loops (int8_rows.h's forward: the weights' vectors
// spilled at 7 rows; few_rows.h's backward: the row offsets kept in vector registers and on the stack). Units over
// the threads, each share writing whole stretches of dst.
template <int64_t Unit>
void row_blocks(const void* src, int64_t ld, int64_t n, int64_t units, void* dst) {
  const auto* s = static_cast<const char*>(src);
  auto* d = static_cast<char*>(dst);
  const int64_t grain = std::max<int64_t>(1, kRowsGrainValues * 2 / std::max<int64_t>(n * Unit, 1));  // 32 KiB
  at::parallel_for(0, units, grain, [&](int64_t c0, int64_t c1) {
    for (int64_t r0 = 0; r0 < n; r0 += kBlockRows) {
      const int64_t R = std::min(kBlockRows, n - r0);
      char* block = d + r0 * units * Unit;
      for (int64_t c = c0; c < c1; ++c)
        for (int64_t r = 0; r < R; ++r) std::memcpy(block + (c * R + r) * Unit, s + (r0 + r) * ld + c * Unit, Unit);
    }
  });
}

}  // namespace moetune_rows
