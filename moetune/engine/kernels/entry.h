// The Python entry points every kernel variant shares: operand checks, decoders built from the format's
// tensors, and the module's functions. A variant's .cpp defines, before including this header (once, last):
//
//   #define MOETUNE_VARIANT "<name>"   // its name in loader.py's registry; the module's `variant`
//   #define MOETUNE_OPERANDS at::kFloat  // optional: the dtype of a and out (default at::kBFloat16)
//   #define MOETUNE_TABLES               // optional (AVX512 loops): decoders' tables built per call (fp8_tables)
//   #define MOETUNE_A8_INT8 / MOETUNE_A8_INT4  // optional: int8_gemm_a8 / int4_gemm_a8 (loader.py's int8_rows),
//                                              // the latter calling the variant's int4_a8 (int4_gemm_a8's arguments,
//                                              // checked, at least one row)
//   std::string variant_unavailable(); // why it cannot run on this CPU / process, or ""
//   template <class Dec>               // one product with the decoded weight W [O, K] (decoders.h), a and out
//   void run_gemm(bool forward, const Dec& dec, const float* row_scale,  // MOETUNE_OPERANDS with contiguous rows,
//                 const torch::Tensor& a, torch::Tensor& out,          // already checked, at least one row:
//                 int64_t O, int64_t K, bool accumulate);
//       forward : out[n, O] (+)= a[n, K] @ W^T, times row_scale[o] (fp32, may be null) on the fp32 sums
//       backward: out[n, K] (+)= (a[n, O] * row_scale, rounded once to the operands' dtype) @ W; a decoder's
//                 group-scaled form (decoders.h: W = S * V) may be taken instead: (a[r, o] * S(o, k), rounded once)
//                 times V (the AVX512-BF16 variant with few rows of a)
//       int8 on the AVX512-BF16 and AVX2 variants: a's rows (backward: times row_scale in fp32) as 16-bit integers
//                 in steps of their largest magnitude / qmax, multiplied with the codes exactly (int16_rows.h,
//                 avx2_int16.h)
//       fp32 sums, rounded once into out (accumulate: added to out's values first).
//
// A new format adds its decoder to decoders.h and one entry point here (and its _run form over a run of experts),
// and no variant changes.
#pragma once

#include <ATen/record_function.h>

#include <memory>
#include <string>
#include <vector>

#include "decoders.h"
#include "ops.h"

#ifndef MOETUNE_OPERANDS
#define MOETUNE_OPERANDS at::kBFloat16
#endif

namespace {

const std::string& unavailable_here() {
  static const std::string status = variant_unavailable();
  return status;
}

void require_variant() { TORCH_CHECK(unavailable_here().empty(), "moetune fused kernels: ", unavailable_here()); }

// An entry point's first statement: the variant checked, and the call recorded as "moetune::<name>" for the
// profiler (torch.profiler sees ATen ops only; without this a kernel's time shows as time no op accounts for, as
// bench/profile_engine.py's "gap"); with no profiler active the record is one flag check
#define MOETUNE_ENTRY(name) \
  require_variant();        \
  RECORD_FUNCTION("moetune::" name, std::vector<c10::IValue>())

void check_operands(const torch::Tensor& a, const torch::Tensor& out, int64_t a_cols, int64_t out_cols) {
  TORCH_CHECK(a.scalar_type() == MOETUNE_OPERANDS && out.scalar_type() == MOETUNE_OPERANDS,
              "operands must be ", c10::toString(MOETUNE_OPERANDS), " (this variant's compute dtype); got ",
              c10::toString(a.scalar_type()), " and ", c10::toString(out.scalar_type()));
  TORCH_CHECK(a.dim() == 2 && out.dim() == 2 && a.size(0) == out.size(0), "2-D operands with equal rows");
  TORCH_CHECK(a.size(1) == a_cols && out.size(1) == out_cols, "operand widths do not match the weight");
  TORCH_CHECK(a.stride(1) == 1 && out.stride(1) == 1, "operands need contiguous rows");
}

template <class Dec>
void run_checked(bool forward, const Dec& dec, const float* row_scale, const torch::Tensor& a, torch::Tensor& out,
                 int64_t O, int64_t K, bool accumulate) {
  check_operands(a, out, forward ? K : O, forward ? O : K);
  if (a.size(0) == 0) return;
  run_gemm(forward, dec, row_scale, a, out, O, K, accumulate);
}

// a: x [n, K] (forward) or g [n, O] (backward); out: [n, O] or [n, K]; w [O, K] bf16 (dense weights), contiguous
// rows stride(0) >= K apart (DenseExperts' padded rows).
void bf16_gemm(bool forward, const torch::Tensor& a, torch::Tensor out, const torch::Tensor& w, bool accumulate) {
  MOETUNE_ENTRY("bf16_gemm");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.dim() == 2 && w.stride(1) == 1 && w.stride(0) >= w.size(1),
              "w: bf16 [O, K] with contiguous rows; got strides ", w.strides());
  run_checked(forward, moetune::Bf16Rows{w.data_ptr<at::BFloat16>(), w.stride(0)}, nullptr, a, out, w.size(0),
              w.size(1), accumulate);
}

// a: x [n, K] (forward) or g [n, O] (backward); out: [n, O] or [n, K]; codes [O, K] int8; scale [O] fp32.
moetune::Int8Rows int8_rows_of(const torch::Tensor& codes, const torch::Tensor& scale) {
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.dim() == 2 && codes.is_contiguous(), "codes: int8 [O, K]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == codes.size(0),
              "scale: fp32 [O]");
  return moetune::Int8Rows{codes.data_ptr<int8_t>(), codes.size(1)};
}

void int8_gemm(bool forward, const torch::Tensor& a, torch::Tensor out, const torch::Tensor& codes,
               const torch::Tensor& scale, bool accumulate) {
  MOETUNE_ENTRY("int8_gemm");
  const moetune::Int8Rows dec = int8_rows_of(codes, scale);
  run_checked(forward, dec, scale.data_ptr<float>(), a, out, codes.size(0), dec.K, accumulate);
}

#ifdef MOETUNE_A8_INT8
// int8_gemm with a's rows as 8-bit integers (the int8 format's opt-in int8 activations: int8_rows.h); the variants
// that define MOETUNE_A8_INT8 (AVX512-BF16) have it
void int8_gemm_a8(bool forward, const torch::Tensor& a, torch::Tensor out, const torch::Tensor& codes,
                  const torch::Tensor& scale, bool accumulate) {
  MOETUNE_ENTRY("int8_gemm_a8");
  const moetune::Int8Rows dec = int8_rows_of(codes, scale);
  const int64_t O = codes.size(0), K = dec.K;
  TORCH_CHECK(O <= moetune_int8::kMaxO, "int8 activations: at most ", moetune_int8::kMaxO,
              " weight rows (exact int32 sums); got ", O);
  check_operands(a, out, forward ? K : O, forward ? O : K);
  const int64_t n = a.size(0);
  if (n == 0) return;
  auto* op = out.data_ptr<at::BFloat16>();
  if (forward)
    moetune_int8::forward(dec, scale.data_ptr<float>(), a.data_ptr<at::BFloat16>(), a.stride(0), n, K, O, op,
                          out.stride(0), accumulate);
  else
    moetune_int8::backward(dec, scale.data_ptr<float>(), a.data_ptr<at::BFloat16>(), a.stride(0), n, K, O, op,
                           out.stride(0), accumulate);
}
#endif

// packed [O, K/2] uint8; scale [O, K/g] bf16; zero [O, K/g] uint8 or None.
moetune::Int4Rows int4_rows_of(const torch::Tensor& packed, const torch::Tensor& scale,
                               const c10::optional<torch::Tensor>& zero, int64_t group) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.is_contiguous(),
              "packed: uint8 [O, K/2]");
  const int64_t O = packed.size(0), K = 2 * packed.size(1);
  TORCH_CHECK(group % 16 == 0 && K % group == 0 && (K / 2) % 16 == 0, "group must be a multiple of 16 dividing K");
  TORCH_CHECK(scale.scalar_type() == at::kBFloat16 && scale.is_contiguous() && scale.numel() == O * (K / group),
              "scale: bf16 [O, K/g]");
  const uint8_t* zp = nullptr;
  if (zero.has_value()) {
    TORCH_CHECK(zero->scalar_type() == at::kByte && zero->is_contiguous() && zero->numel() == O * (K / group),
                "zero: uint8 [O, K/g]");
    zp = zero->data_ptr<uint8_t>();
  }
  TORCH_CHECK((group & (group - 1)) == 0, "group must be a power of two");
  return moetune::Int4Rows{packed.data_ptr<uint8_t>(), scale.data_ptr<at::BFloat16>(), zp, K / 2, K / group,
                           __builtin_ctzll(static_cast<unsigned long long>(group))};
}

void int4_gemm(bool forward, const torch::Tensor& a, torch::Tensor out, const torch::Tensor& packed,
               const torch::Tensor& scale, const c10::optional<torch::Tensor>& zero, int64_t group,
               bool accumulate) {
  MOETUNE_ENTRY("int4_gemm");
  const moetune::Int4Rows dec = int4_rows_of(packed, scale, zero, group);
  run_checked(forward, dec, nullptr, a, out, packed.size(0), 2 * dec.half, accumulate);
}

#ifdef MOETUNE_A8_INT4
// int4_gemm with a's rows as 8-bit integers (int8_activations): the variant's int4_a8 (int8_rows.h, avx2_int8.h)
void int4_gemm_a8(bool forward, const torch::Tensor& a, torch::Tensor out, const torch::Tensor& packed,
                  const torch::Tensor& scale, const c10::optional<torch::Tensor>& zero, int64_t group,
                  bool accumulate) {
  MOETUNE_ENTRY("int4_gemm_a8");
  const moetune::Int4Rows dec = int4_rows_of(packed, scale, zero, group);
  const int64_t O = packed.size(0), K = 2 * dec.half;
  TORCH_CHECK(group >= 32 && group <= 128, "int8 activations: groups of 32, 64 or 128; got ", group);
  check_operands(a, out, forward ? K : O, forward ? O : K);
  if (a.size(0) == 0) return;
  int4_a8(forward, dec, a, out, O, K, accumulate);
}
#endif

// codes [O, K] e4m3fn; scale_inv [R, ceil(K/128)] fp32, the grid rows of both segments: rows from seg on take
// grid rows from seg_grid = ceil(seg / 128) (gate_up: up's grid after gate's; one segment: seg = 0).
void fp8_block_gemm(bool forward, const torch::Tensor& a, torch::Tensor out, const torch::Tensor& codes,
                    const torch::Tensor& scale_inv, int64_t seg, int64_t seg_grid, bool accumulate) {
  MOETUNE_ENTRY("fp8_block_gemm");
  TORCH_CHECK(codes.scalar_type() == at::kFloat8_e4m3fn && codes.dim() == 2 && codes.is_contiguous(),
              "codes: float8_e4m3fn [O, K]");
  const int64_t O = codes.size(0), K = codes.size(1), cols = (K + 127) / 128;
  TORCH_CHECK(0 <= seg && seg <= O && seg_grid == (seg + 127) / 128, "seg in [0, O], seg_grid = ceil(seg / 128)");
  TORCH_CHECK(scale_inv.scalar_type() == at::kFloat && scale_inv.is_contiguous() && scale_inv.dim() == 2 &&
                  scale_inv.size(0) == seg_grid + (O - seg + 127) / 128 && scale_inv.size(1) == cols,
              "scale_inv: fp32 [grid rows, ceil(K/128)]");
  moetune::Fp8BlockRows dec{static_cast<const int8_t*>(codes.data_ptr()), scale_inv.data_ptr<float>(), K, cols,
                            seg, seg_grid};
#ifdef MOETUNE_TABLES
  // every block's 128 magnitudes once per call (gate_up [1536, 2048]: 192 blocks, 48 KiB), looked up per 32 codes
  std::unique_ptr<uint16_t[]> table(new uint16_t[scale_inv.numel() * 128]);
  moetune::fp8_tables(scale_inv.data_ptr<float>(), scale_inv.numel(), table.get());
  dec.table = table.get();
#endif
  run_checked(forward, dec, nullptr, a, out, O, K, accumulate);
}

// packed [O, K/2] uint8 (two e2m1 codes per byte, low nibble first); scale [O, K/32] uint8 (e8m0).
void mxfp4_gemm(bool forward, const torch::Tensor& a, torch::Tensor out, const torch::Tensor& packed,
                const torch::Tensor& scale, bool accumulate) {
  MOETUNE_ENTRY("mxfp4_gemm");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.is_contiguous(),
              "packed: uint8 [O, K/2]");
  const int64_t O = packed.size(0), K = 2 * packed.size(1);
  TORCH_CHECK(K % 32 == 0, "K must be a multiple of 32");
  TORCH_CHECK(scale.scalar_type() == at::kByte && scale.is_contiguous() && scale.numel() == O * (K / 32),
              "scale: uint8 [O, K/32]");
  moetune::Mxfp4Rows dec{packed.data_ptr<uint8_t>(), scale.data_ptr<uint8_t>(), K / 2, K / 32};
  run_checked(forward, dec, nullptr, a, out, O, K, accumulate);
}

// The kernels over a run of experts, one call (and one GIL hand-off) for the run: for each (e, s0, s1) of
// segs, rows s0:s1 of out from rows s0 - a_offset : s1 - a_offset of a, with expert e's weights (the first
// dimension of every weight tensor, [E, ...]).
template <class F>
void each_segment(const std::vector<int64_t>& segs, const torch::Tensor& a, int64_t a_offset, const torch::Tensor& out,
                  F&& one) {
  moetune_ops::for_each_segment(segs, [&](int64_t e, int64_t s0, int64_t s1) {
    one(e, a.slice(0, s0 - a_offset, s1 - a_offset), out.slice(0, s0, s1));
  });
}

void bf16_gemm_run(bool forward, const torch::Tensor& a, int64_t a_offset, const torch::Tensor& out,
                   const std::vector<int64_t>& segs, const torch::Tensor& w, bool accumulate) {
  each_segment(segs, a, a_offset, out, [&](int64_t e, const torch::Tensor& a_e, const torch::Tensor& out_e) {
    bf16_gemm(forward, a_e, out_e, w.select(0, e), accumulate);
  });
}

// int8_gemm_run and int8_gemm_a8_run: Gemm over a run of experts
template <decltype(&int8_gemm) Gemm>
void int8_run(bool forward, const torch::Tensor& a, int64_t a_offset, const torch::Tensor& out,
              const std::vector<int64_t>& segs, const torch::Tensor& codes, const torch::Tensor& scale,
              bool accumulate) {
  each_segment(segs, a, a_offset, out, [&](int64_t e, const torch::Tensor& a_e, const torch::Tensor& out_e) {
    Gemm(forward, a_e, out_e, codes.select(0, e), scale.select(0, e), accumulate);
  });
}

// int4_gemm_run and int4_gemm_a8_run: Gemm over a run of experts
template <decltype(&int4_gemm) Gemm>
void int4_run(bool forward, const torch::Tensor& a, int64_t a_offset, const torch::Tensor& out,
              const std::vector<int64_t>& segs, const torch::Tensor& packed, const torch::Tensor& scale,
              const c10::optional<torch::Tensor>& zero, int64_t group, bool accumulate) {
  each_segment(segs, a, a_offset, out, [&](int64_t e, const torch::Tensor& a_e, const torch::Tensor& out_e) {
    c10::optional<torch::Tensor> z;
    if (zero.has_value()) z = zero->select(0, e);
    Gemm(forward, a_e, out_e, packed.select(0, e), scale.select(0, e), z, group, accumulate);
  });
}

void fp8_block_gemm_run(bool forward, const torch::Tensor& a, int64_t a_offset, const torch::Tensor& out,
                        const std::vector<int64_t>& segs, const torch::Tensor& codes, const torch::Tensor& scale_inv,
                        int64_t seg, int64_t seg_grid, bool accumulate) {
  each_segment(segs, a, a_offset, out, [&](int64_t e, const torch::Tensor& a_e, const torch::Tensor& out_e) {
    fp8_block_gemm(forward, a_e, out_e, codes.select(0, e), scale_inv.select(0, e), seg, seg_grid, accumulate);
  });
}

void mxfp4_gemm_run(bool forward, const torch::Tensor& a, int64_t a_offset, const torch::Tensor& out,
                    const std::vector<int64_t>& segs, const torch::Tensor& packed, const torch::Tensor& scale,
                    bool accumulate) {
  each_segment(segs, a, a_offset, out, [&](int64_t e, const torch::Tensor& a_e, const torch::Tensor& out_e) {
    mxfp4_gemm(forward, a_e, out_e, packed.select(0, e), scale.select(0, e), accumulate);
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("variant") = MOETUNE_VARIANT;
  m.def("unavailable", [] { return unavailable_here(); }, "why the kernels cannot run here, or '' when they can");
  // the GIL is released, as torch's own ops do: the engine runs experts in parallel Python threads
  m.def("bf16_gemm", &bf16_gemm, "bf16 (dense weights) GEMM (forward: x @ W^T, backward: g @ W)",
        py::call_guard<py::gil_scoped_release>());
  m.def("int8_gemm", &int8_gemm, "int8 per-row-scale GEMM (forward: x @ W^T, backward: g @ W)",
        py::call_guard<py::gil_scoped_release>());
#ifdef MOETUNE_A8_INT8
  m.def("int8_gemm_a8", &int8_gemm_a8, "int8_gemm with the activations as 8-bit integers per row",
        py::call_guard<py::gil_scoped_release>());
  m.def("int8_gemm_a8_run", &int8_run<int8_gemm_a8>, "int8_gemm_a8 over a run of experts",
        py::call_guard<py::gil_scoped_release>());
#endif
#ifdef MOETUNE_A8_INT4
  m.def("int4_gemm_a8", &int4_gemm_a8, "int4_gemm with the activations as 8-bit integers per row",
        py::call_guard<py::gil_scoped_release>());
  m.def("int4_gemm_a8_run", &int4_run<int4_gemm_a8>, "int4_gemm_a8 over a run of experts",
        py::call_guard<py::gil_scoped_release>());
#endif
  m.def("int4_gemm", &int4_gemm, "int4 group-wise GEMM (forward: x @ W^T, backward: g @ W)",
        py::call_guard<py::gil_scoped_release>());
  m.def("fp8_block_gemm", &fp8_block_gemm, "fp8 e4m3 128x128-block GEMM (forward: x @ W^T, backward: g @ W)",
        py::call_guard<py::gil_scoped_release>());
  m.def("mxfp4_gemm", &mxfp4_gemm, "mxfp4 GEMM (forward: x @ W^T, backward: g @ W)",
        py::call_guard<py::gil_scoped_release>());
  m.def("bf16_gemm_run", &bf16_gemm_run, "bf16_gemm over a run of experts", py::call_guard<py::gil_scoped_release>());
  m.def("int8_gemm_run", &int8_run<int8_gemm>, "int8_gemm over a run of experts",
        py::call_guard<py::gil_scoped_release>());
  m.def("int4_gemm_run", &int4_run<int4_gemm>, "int4_gemm over a run of experts",
        py::call_guard<py::gil_scoped_release>());
  m.def("fp8_block_gemm_run", &fp8_block_gemm_run, "fp8_block_gemm over a run of experts",
        py::call_guard<py::gil_scoped_release>());
  m.def("mxfp4_gemm_run", &mxfp4_gemm_run, "mxfp4_gemm over a run of experts",
        py::call_guard<py::gil_scoped_release>());
  // the engine's per-expert op sequences (ops.h), any dtype, whatever the variant's ISA
  m.def("split_mm", &moetune_ops::split_mm, "RowSplit.mm", py::call_guard<py::gil_scoped_release>());
  m.def("split_mm_t", &moetune_ops::split_mm_t, "RowSplit.mm_t", py::call_guard<py::gil_scoped_release>());
  m.def("mm_wt", &moetune_ops::mm_wt, "BlockedGemm.matmul_wt, few rows", py::call_guard<py::gil_scoped_release>());
  m.def("dense_run", &moetune_ops::dense_run, "BlockedGemm.matmul_wt / matmul_w over a run of experts",
        py::call_guard<py::gil_scoped_release>());
  m.def("lora_forward_run", &moetune_ops::lora_forward_run, "LoraPass.forward_run",
        py::call_guard<py::gil_scoped_release>());
  m.def("lora_backward_run", &moetune_ops::lora_backward_run, "LoraPass.backward_run",
        py::call_guard<py::gil_scoped_release>());
}
