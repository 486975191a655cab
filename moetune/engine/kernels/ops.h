// The engine's per-expert sequences of torch ops, as one call each with the GIL released (every variant module
// has them: they are ATen calls, no ISA-specific code). Each one does exactly what its Python reference does, op
// for op, so results are bit for bit the same:
//
//   split_mm, split_mm_t   moetune/engine/shapes.py   RowSplit.mm, RowSplit.mm_t
//   mm_wt                  moetune/engine/gemm.py     BlockedGemm.matmul_wt's few-row form (weight as left operand)
//   dropout_mask           moetune/engine/lora.py     dropout_mask (the same generator seed, the same draws)
//   lora_forward_run       moetune/engine/lora.py     LoraPass.forward_run
//   lora_backward_run      moetune/engine/lora.py     LoraPass.backward_run
//   dense_run              moetune/engine/gemm.py     BlockedGemm.matmul_wt / matmul_w over a run of experts whose
//                                                     weights are stored in the compute dtype
//
// Why: a Python worker thread of the expert pool takes the GIL back after every torch op it calls; an expert's
// LoRA projection was ~60 such ops (slices, padded copies, GEMMs) and its base GEMMs ~30 more, and with several
// workers those hand-offs, not the arithmetic, bounded the engine on many cores (docs/performance.md, "Thread
// scaling on 16 cores"). Here each sequence is one hand-off, and the *_run functions take a whole run of experts
// (segs: (expert, first row, end row) triples of the rows sorted by expert) in one.
//
// Rows are cut as engine/shapes.py's row_pieces cuts them (split = true): pieces of 512 rows, then the tail
// padded to 1-16, a multiple of 16 up to 64, or of 32 above; split = false runs the whole rows. Padded pieces
// run on this thread's scratch (zero padding rows where a product sums over rows).
#pragma once

#include <torch/extension.h>

#include <array>
#include <vector>

namespace moetune_ops {

struct Piece {
  int64_t r0, r1, rows;  // rows: the GEMM's row count (> r1 - r0: zero-padded)
};

inline std::vector<Piece> pieces(int64_t n, bool split) {
  std::vector<Piece> out;
  if (!split || n <= 0) {
    out.push_back({0, n, n});
    return out;
  }
  int64_t r0 = 0;
  while (n - r0 >= 512) {
    out.push_back({r0, r0 + 512, 512});
    r0 += 512;
  }
  if (n > r0) {
    const int64_t tail = n - r0, step = tail <= 64 ? 16 : 32;
    out.push_back({r0, n, tail <= 16 ? tail : (tail + step - 1) / step * step});
  }
  return out;
}

// This thread's scratch buffer `slot` as [rows, cols] of `dtype` (grown as needed; valid until the next use of
// the slot on this thread). Separate buffers inside and outside inference mode (as the Python Workspace keeps
// them): one made under torch.inference_mode is an inference tensor, which no op outside it may write.
enum Slot { kSplitA, kSplitB, kSplitOut, kWtTmp, kLoraGb, kLoraProj, kSlots };

inline at::Tensor scratch(Slot slot, int64_t rows, int64_t cols, at::ScalarType dtype) {
  thread_local std::array<std::array<at::Tensor, kSlots>, 2> bufs;
  at::Tensor& buf = bufs[c10::InferenceMode::is_enabled() ? 1 : 0][slot];
  const int64_t need = rows * cols;
  if (!buf.defined() || buf.scalar_type() != dtype || buf.numel() < need) {
    buf = at::empty({std::max<int64_t>(need, 1)}, at::TensorOptions().dtype(dtype));
  }
  return buf.narrow(0, 0, need).view({rows, cols});
}

// rows r0:r1 of t [n, D], or (padded piece) a copy in scratch `slot` [rows, D] whose extra rows are zero
inline at::Tensor padded_rows(const at::Tensor& t, const Piece& p, Slot slot) {
  if (p.rows == p.r1 - p.r0) return t.slice(0, p.r0, p.r1);
  at::Tensor buf = scratch(slot, p.rows, t.size(1), t.scalar_type());
  buf.slice(0, 0, p.r1 - p.r0).copy_(t.slice(0, p.r0, p.r1));
  buf.slice(0, p.r1 - p.r0).zero_();
  return buf;
}

// fn(e, s0, s1) for each (expert, first row, end row) triple of segs, a run of experts' rows sorted by expert
template <class F>
void for_each_segment(const std::vector<int64_t>& segs, F&& fn) {
  TORCH_CHECK(segs.size() % 3 == 0, "segs: (expert, start, end) triples");
  for (size_t i = 0; i < segs.size(); i += 3) fn(segs[i], segs[i + 1], segs[i + 2]);
}

// out [n, D] = beta * out + alpha * a [n, K] @ b [K, D], piece by piece of the n rows (RowSplit.mm)
void split_mm(const at::Tensor& a, const at::Tensor& b, at::Tensor out, double beta, double alpha, bool split) {
  const bool plain = beta == 0.0 && alpha == 1.0;
  for (const Piece& p : pieces(a.size(0), split)) {
    const at::Tensor a_p = padded_rows(a, p, kSplitA);
    const bool padded = p.rows != p.r1 - p.r0;
    at::Tensor o;
    if (!padded) {
      o = out.slice(0, p.r0, p.r1);
    } else {
      o = scratch(kSplitOut, p.rows, out.size(1), out.scalar_type());
      if (beta != 0.0) o.slice(0, 0, p.r1 - p.r0).copy_(out.slice(0, p.r0, p.r1));
    }
    if (plain) {
      at::mm_out(o, a_p, b);
    } else {
      o.addmm_(a_p, b, beta, alpha);
    }
    if (padded) out.slice(0, p.r0, p.r1).copy_(o.slice(0, 0, p.r1 - p.r0));
  }
}

// out [P, D] (any dtype and strides) = a [n, P]^T @ b [n, D]: each piece's product in a's dtype, written then
// added into out (RowSplit.mm_t)
void split_mm_t(const at::Tensor& a, const at::Tensor& b, at::Tensor out, bool split) {
  bool first = true;
  for (const Piece& p : pieces(a.size(0), split)) {
    const at::Tensor part = at::matmul(padded_rows(a, p, kSplitA).t(), padded_rows(b, p, kSplitB));
    if (first) {
      out.copy_(part);
    } else {
      out.add_(part);
    }
    first = false;
  }
}

// dst [n, R] (+)= inp [n, D_in] @ w [R, D_in]^T, computed as w @ inp^T per piece and written transposed; with
// scale [R] (fp32): the product times the scale, rounded once into dst (BlockedGemm.matmul_wt, few rows)
void mm_wt(const at::Tensor& w, const at::Tensor& inp, at::Tensor dst, const c10::optional<at::Tensor>& scale,
           bool accumulate, bool split) {
  const int64_t r = w.size(0);
  for (const Piece& p : pieces(inp.size(0), split)) {
    at::Tensor tmp = scratch(kWtTmp, r, p.rows, inp.scalar_type());
    at::mm_out(tmp, w, padded_rows(inp, p, kSplitA).t());
    const at::Tensor res = tmp.slice(1, 0, p.r1 - p.r0).t();
    at::Tensor d = dst.slice(0, p.r0, p.r1);
    if (!scale.has_value()) {
      if (accumulate) {
        d.add_(res);
      } else {
        d.copy_(res);
      }
    } else if (accumulate) {
      d.addcmul_(res, *scale);
    } else {
      at::mul_out(d, res, *scale);
    }
  }
}

// A run of experts' base GEMMs on weights stored in the compute dtype (BlockedGemm.matmul_wt_run / matmul_w_run).
// w [E, D_out, D_in]; segs: (expert, first row, end row) triples of rows of out, which holds every expert's rows
// (sorted by expert); inp's rows are those minus inp_offset (inp may hold the run's rows alone).
// forward: out[s0:s1] (+)= inp[s0:s1] @ w[e]^T, as mm_wt with up to small_rows rows, else as split_mm;
// backward: out[s0:s1] (+)= inp[s0:s1] @ w[e] (inp: the gradient at the output), as split_mm.
void dense_run(bool forward, const at::Tensor& w, const at::Tensor& inp, int64_t inp_offset, at::Tensor out,
               const std::vector<int64_t>& segs, bool accumulate, int64_t small_rows, bool split) {
  for_each_segment(segs, [&](int64_t e, int64_t s0, int64_t s1) {
    const at::Tensor w_e = w.select(0, e), a = inp.slice(0, s0 - inp_offset, s1 - inp_offset);
    at::Tensor o = out.slice(0, s0, s1);
    if (!forward) {
      split_mm(a, w_e, o, accumulate ? 1.0 : 0.0, 1.0, split);
    } else if (s1 - s0 > small_rows) {
      split_mm(a, w_e.t(), o, accumulate ? 1.0 : 0.0, 1.0, split);
    } else {
      mm_wt(w_e, a, o, c10::nullopt, accumulate, split);
    }
  });
}

// LoRA dropout of one pass: seed < 0 none; else expert e's keep-mask of projection proj_id (0 gate_up, 1 down)
struct Dropout {
  int64_t seed;
  double p;
  int64_t proj_id;
};

// lora.py's dropout_mask: bernoulli(1 - p) / (1 - p) over `shape`, drawn from a CPU generator seeded with
// (seed * 1000003 + expert * 2 + proj) mod 2^63 (unsigned arithmetic wraps mod 2^64, of which 2^63 divides)
at::Tensor dropout_mask(const Dropout& d, int64_t e, at::IntArrayRef shape, at::ScalarType dtype) {
  const uint64_t mixed = static_cast<uint64_t>(d.seed) * 1000003ULL + static_cast<uint64_t>(e) * 2ULL +
                         static_cast<uint64_t>(d.proj_id);
  at::Generator gen = at::detail::createCPUGenerator(mixed & ((1ULL << 63) - 1));
  at::Tensor mask = at::empty(shape, at::TensorOptions().dtype(dtype));
  mask.bernoulli_(1.0 - d.p, gen);
  return mask.div_(1.0 - d.p);
}

// LoraPass.forward: out [n, D_out] = s * drop(inp) A_e^T B_e^T (written: the base GEMM accumulates into it); the
// A-projection drop(inp) A_e^T [n, r] into a_out. a [E, r, D_in], b [E, D_out, r]: expert e's are used.
void lora_forward(const at::Tensor& inp, const at::Tensor& a, const at::Tensor& b, int64_t e, at::Tensor out,
                  at::Tensor a_out, double scaling, bool split, const Dropout& drop) {
  const at::Tensor a_e = a.select(0, e), b_e = b.select(0, e);
  const at::Tensor dropped = drop.seed < 0 ? inp : inp * dropout_mask(drop, e, inp.sizes(), inp.scalar_type());
  split_mm(dropped, a_e.t(), a_out, 0.0, 1.0, split);
  split_mm(a_out, b_e.t(), out, 0.0, scaling, split);
}

// LoraPass.backward, for expert e of a [E, r, D_in] and b [E, D_out, r]: g_in [n, D_in] = s (g_out B_e) A_e (times
// the dropout mask; written), and expert e's grads in grad_a [E, r, D_in] and grad_b [E, D_out, r] (fp32, written)
// from g_out [n, D_out], inp [n, D_in], the forward's A-projection a_proj [n, r] (or None: recomputed) and the
// routing weights w_e [n, 1] (or None: g_out is weighted already).
void lora_backward(const at::Tensor& g_out, at::Tensor g_in, const at::Tensor& inp,
                   const c10::optional<at::Tensor>& a_proj, const c10::optional<at::Tensor>& w_e,
                   const at::Tensor& a, const at::Tensor& b, int64_t e, const at::Tensor& grad_a,
                   const at::Tensor& grad_b, double scaling, bool split, const Dropout& drop) {
  const at::Tensor a_e = a.select(0, e), b_e = b.select(0, e);
  at::Tensor grad_a_e = grad_a.select(0, e), grad_b_e = grad_b.select(0, e);
  const int64_t n = g_out.size(0), rank = a_e.size(0);
  at::Tensor gb = scratch(kLoraGb, n, rank, g_out.scalar_type());
  split_mm(g_out, b_e, gb, 0.0, 1.0, split);
  at::Tensor dropped = inp;
  if (drop.seed < 0) {
    split_mm(gb, a_e, g_in, 0.0, scaling, split);
  } else {  // the mask applies to the gradient flowing back into the input too
    const at::Tensor mask = dropout_mask(drop, e, inp.sizes(), inp.scalar_type());
    dropped = inp * mask;
    split_mm(gb, a_e, g_in, 0.0, 1.0, split);
    g_in.mul_(mask).mul_(scaling);
  }
  at::Tensor ap;
  if (a_proj.has_value()) {
    ap = *a_proj;
  } else {
    ap = scratch(kLoraProj, n, rank, inp.scalar_type());
    split_mm(dropped, a_e.t(), ap, 0.0, 1.0, split);
  }
  if (w_e.has_value()) {
    gb = gb * *w_e;
    ap = ap * *w_e;
  }
  split_mm_t(gb, dropped, grad_a_e, split);
  grad_a_e.mul_(scaling);
  // (a^T g)^T, not g^T a: the [r, n] x [n, D] form runs faster (see LoraPass.backward)
  split_mm_t(ap, g_out, grad_b_e.t(), split);
  grad_b_e.mul_(scaling);
}

// lora_forward for each (e, s0, s1) of segs on rows s0:s1 of inp, out and a_out; seed < 0: no dropout
void lora_forward_run(const at::Tensor& inp, const at::Tensor& a, const at::Tensor& b, const std::vector<int64_t>& segs,
                      const at::Tensor& out, const at::Tensor& a_out, double scaling, bool split, int64_t seed,
                      double dropout, int64_t proj_id) {
  const Dropout drop{seed, dropout, proj_id};
  for_each_segment(segs, [&](int64_t e, int64_t s0, int64_t s1) {
    lora_forward(inp.slice(0, s0, s1), a, b, e, out.slice(0, s0, s1), a_out.slice(0, s0, s1), scaling, split, drop);
  });
}

// lora_backward for each (e, s0, s1) of segs on rows s0:s1 of g_in, inp, a_proj and w, and rows
// s0 - g_out_offset : s1 - g_out_offset of g_out (which may hold the run's rows alone); seed < 0: no dropout
void lora_backward_run(const at::Tensor& g_out, int64_t g_out_offset, const at::Tensor& g_in, const at::Tensor& inp,
                       const c10::optional<at::Tensor>& a_proj, const c10::optional<at::Tensor>& w,
                       const at::Tensor& a, const at::Tensor& b, const std::vector<int64_t>& segs,
                       const at::Tensor& grad_a, const at::Tensor& grad_b, double scaling, bool split, int64_t seed,
                       double dropout, int64_t proj_id) {
  const Dropout drop{seed, dropout, proj_id};
  for_each_segment(segs, [&](int64_t e, int64_t s0, int64_t s1) {
    c10::optional<at::Tensor> ap, we;
    if (a_proj.has_value()) ap = a_proj->slice(0, s0, s1);
    if (w.has_value()) we = w->slice(0, s0, s1);
    lora_backward(g_out.slice(0, s0 - g_out_offset, s1 - g_out_offset), g_in.slice(0, s0, s1), inp.slice(0, s0, s1),
                  ap, we, a, b, e, grad_a, grad_b, scaling, split, drop);
  });
}

}  // namespace moetune_ops
