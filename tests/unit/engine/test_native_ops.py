"""The per-expert op sequences compiled as one call each (``kernels/ops.h``) against their Python references
(``RowSplit.mm`` / ``mm_t``, ``BlockedGemm.matmul_wt``'s few-row form, ``LoraPass.forward`` / ``backward``): the
same ops in the same order, so every result must be equal bit for bit, not close. Then whole engines (bf16 and
fp32, lora / frozen / full, both policies, batched LoRA on and off, biases, tied gate/up rows, dropout, the expert
pool) with the sequences compiled equal the same engines with them in Python, and the engine's float64 reference
bounds both.
"""

from __future__ import annotations

import pytest
import torch

from moetune.engine import EngineOptions, ExpertLoRA
from moetune.engine.formats import DenseExperts
from moetune.engine.gemm import BlockedGemm
from moetune.engine.lora import LoraPass
from moetune.engine.shapes import RowSplit, native_ops, native_ops_available
from moetune.engine.workspace import Workspace
from tests.unit.engine import test_fused_kernels
from tests.unit.engine_cases import build_module, make_layer, make_routing, rel_err, run_module, run_reference


def _why_not() -> str:
    if not test_fused_kernels.HAS_COMPILER:
        return "no C++ compiler (c++/g++) on PATH"
    from moetune.engine.kernels import fused_unavailable

    return "" if native_ops_available() else f"the kernels do not load here: {fused_unavailable()}"


pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(bool(_why_not()), reason=_why_not() or "-"),
]

# tails of every kind: exact 1-16, padded to 16-multiples up to 64 and 32-multiples above, 512-row pieces
ROWS = (0, 1, 5, 16, 17, 40, 64, 65, 100, 511, 512, 513, 700)
DTYPES = (torch.bfloat16, torch.float32)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rand(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed)).to(dtype)


def _pair(split: bool) -> tuple[RowSplit, RowSplit]:
    return RowSplit(split, native=False), RowSplit(split, native=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", ROWS)
def test_split_mm_equals_its_reference(n: int, dtype: torch.dtype) -> None:
    a, b = (
        _rand(n, 48, dtype=dtype, seed=n),
        _rand(24, 48, dtype=dtype, seed=n + 1).t(),
    )  # b strided, as W.t()
    start = _rand(n, 24, dtype=dtype, seed=n + 2)
    for split in (True, False):
        for beta, alpha in ((0.0, 1.0), (0.0, 0.5), (1.0, 1.0), (1.0, 2.0)):
            outs = []
            for rs in _pair(split):
                out = start.clone()
                rs.mm(a, b, out, beta=beta, alpha=alpha)
                outs.append(out)
            assert torch.equal(outs[0], outs[1]), (split, beta, alpha)
    # into a column slice of a wider buffer (BlockedGemm's row blocks)
    outs = []
    for rs in _pair(True):
        wide = torch.zeros(n, 40, dtype=dtype)
        rs.mm(a, b, wide[:, 8:32], beta=1.0)
        outs.append(wide)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", ROWS)
def test_split_mm_t_equals_its_reference(n: int, dtype: torch.dtype) -> None:
    a, b = _rand(n, 6, dtype=dtype, seed=n), _rand(n, 20, dtype=dtype, seed=n + 1)
    for split in (True, False):
        outs = []
        for rs in _pair(split):
            out = torch.full((6, 20), 3.0, dtype=torch.float32)  # fp32 grads, as LoRA's
            out_t = torch.full((20, 6), 3.0, dtype=torch.float32)
            rs.mm_t(a, b, out)
            rs.mm_t(a, b, out_t.t())  # a transposed view, as the B grads
            outs.append((out, out_t))
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1]), split
        if n:  # and it is the product itself
            ref = a.double().t() @ b.double()
            assert rel_err(outs[1][0], ref) < (2e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", (0, 1, 7, 16, 20, 64, 100, 128))
def test_few_row_forward_gemm_equals_its_reference(n: int, dtype: torch.dtype) -> None:
    """``BlockedGemm.matmul_wt``'s weight-left form (n <= SMALL_ROWS), with and without a row scale."""
    weights = DenseExperts(_rand(3, 32, 40, dtype=dtype, seed=1), _rand(3, 40, 16, dtype=dtype, seed=2))
    inp = _rand(n, 40, dtype=dtype, seed=n)
    start = _rand(n, 32, dtype=dtype, seed=n + 5)
    scale = torch.rand(32, generator=_gen(9)) + 0.5
    for split in (True, False):
        for accumulate in (False, True):
            outs = []
            for rs in _pair(split):
                gemm = BlockedGemm(weights, dtype, split=rs)
                out = start.clone()
                gemm.matmul_wt("gate_up", 1, inp, out, accumulate=accumulate)
                scaled = start.clone()  # the scaled-codes form, on the same operands
                if rs.native:
                    native_ops().mm_wt(weights.gate_up[1], inp, scaled, scale, accumulate, split)
                else:
                    _scaled_reference(weights.gate_up[1], inp, scaled, scale, accumulate, rs)
                outs.append((out, scaled))
            assert torch.equal(outs[0][0], outs[1][0]), (split, accumulate)
            assert torch.equal(outs[0][1], outs[1][1]), (split, accumulate)


def _scaled_reference(w, inp, dst, scale, accumulate, rs: RowSplit) -> None:
    """``matmul_wt``'s loop for one block with a row scale (its scaled-codes path), as written there."""
    for c0, c1, rows in rs.pieces(inp.shape[0]):
        pad = torch.zeros(rows, inp.shape[1], dtype=inp.dtype)
        pad[: c1 - c0] = inp[c0:c1]
        res = (w @ pad.t())[:, : c1 - c0].t()
        d = dst[c0:c1]
        d.addcmul_(res, scale) if accumulate else torch.mul(res, scale, out=d)


def _lora(e: int, h: int, i: int, r: int, seed: int) -> ExpertLoRA:
    lo = ExpertLoRA.init(e, h, i, r, 2.0 * r + 3, generator=_gen(seed))
    lo.gate_up_B.normal_(generator=_gen(seed + 1))
    lo.down_B.normal_(generator=_gen(seed + 2))
    return lo


@pytest.mark.parametrize("seed", [None, 7, 2**62 - 5], ids=["no-dropout", "dropout", "dropout-big-seed"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", (1, 17, 64, 130, 600))
def test_lora_pass_equals_its_reference(n: int, dtype: torch.dtype, seed: int | None) -> None:
    """One expert's LoRA forward and backward, compiled against Python; with dropout the compiled call draws the
    masks itself, from the same seeds (a seed near 2^62 checks the mod-2^63 mixing), so they must be the same."""
    lo = _lora(4, 40, 24, 6, seed=n)
    if seed is not None:
        lo.dropout = 0.3
    inp, g_out = _rand(n, 40, dtype=dtype, seed=n), _rand(n, 48, dtype=dtype, seed=n + 1)
    w_e = torch.rand(n, 1, generator=_gen(n)).to(dtype)
    for split in (True, False):
        for keep_proj in (True, False):
            for weighted in (True, False):
                results = []
                for rs in _pair(split):
                    lp = LoraPass(lo, dtype, seed, rs, Workspace())
                    out, a_out = torch.empty(n, 48, dtype=dtype), torch.empty(n, 6, dtype=dtype)
                    lp.forward_run("gate_up", ((2, 0, n),), inp, out, a_out)
                    g_in, grads = torch.empty(n, 40, dtype=dtype), lp.new_grads(zeroed=True)
                    a_proj, w = (a_out if keep_proj else None), (w_e if weighted else None)
                    lp.backward_run("gate_up", ((2, 0, n),), grads, g_out, g_in, inp, a_proj, w)
                    results.append((out, a_out, g_in, *grads.values()))
                for x, y in zip(*results):
                    assert torch.equal(x, y), (split, keep_proj, weighted)


ENGINE_CASES = {
    "lora-retain": {},
    "lora-recompute": {"policy": "recompute"},
    "lora-per-expert": {"batch_lora": False},
    "lora-bias": {"bias": True},
    "lora-dropout": {"dropout": 0.2},
    "frozen": {"lora": False},
    "full-lora": {"full": True, "bias": True},
    "pool": {"expert_workers": 2},
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(ENGINE_CASES))
def test_engine_with_compiled_sequences_equals_python(case: str, dtype: torch.dtype) -> None:
    """Whole engines, forward and every gradient, compiled against Python sequences: equal bit for bit (the pool
    case on 2 threads: the same per-expert arithmetic, another schedule). Both against the float64 loop."""
    opts = dict(ENGINE_CASES[case])
    lora, bias, full = opts.pop("lora", True), opts.pop("bias", False), opts.pop("full", False)
    dropout = opts.pop("dropout", 0.0)
    layer = make_layer(E=8, H=40, I=24, r=4, lora=lora, bias=bias)
    x, ids, w = make_routing(150, 8, 3, 40, seed=3)  # ~56 rows per expert: 17-64-row tails, padded pieces
    gy = torch.randn(150, 40, generator=_gen(4), dtype=torch.float64)
    if "policy" in opts:
        from moetune.engine import ActivationPolicy

        opts["policy"] = ActivationPolicy(opts["policy"])
    if "expert_workers" in opts:
        torch.set_num_threads(2)  # the one_thread fixture puts it back
    runs = []
    for native in (False, True):
        torch.manual_seed(11)  # the dropout seed
        mod = build_module(layer, dtype=dtype, full=full, dropout=dropout, native_ops=native, **opts)
        assert mod.engine.split.native is native
        runs.append(run_module(mod, x.to(dtype), ids, w.to(dtype), gy))
    (y0, g0), (y1, g1) = runs
    assert torch.equal(y0, y1)
    assert g0.keys() == g1.keys()
    for name in g0:
        assert torch.equal(g0[name], g1[name]), name
    if dropout:
        return  # the float64 loop would need the engine's masks; test_engine_reference covers them
    y_ref, g_ref = run_reference(layer, x, ids, w, gy, full=full)
    bound = 3e-2 if dtype == torch.bfloat16 else 1e-4
    assert rel_err(y1, y_ref) < bound
    assert rel_err(g1["x"], g_ref["x"]) < bound


def test_engines_run_compiled_wherever_the_kernels_load(monkeypatch) -> None:
    """By default an engine runs the sequences compiled here (the kernels load: not skipped); with the kernels
    turned off (``MOETUNE_KERNELS=off``) in Python; ``native_ops=False`` asks for Python."""
    layer = make_layer(E=4, H=16, I=8, r=2)
    assert build_module(layer, dtype=torch.float32).engine.split.native
    assert not build_module(layer, dtype=torch.float32, native_ops=False).engine.split.native
    monkeypatch.setenv("MOETUNE_KERNELS", "off")
    assert not build_module(layer, dtype=torch.bfloat16).engine.split.native
    assert not RowSplit.for_dtype(torch.bfloat16).native


def test_a_copied_engine_keeps_its_choice() -> None:
    """A deep copy (``copy.deepcopy`` of a model) holds no module object: it resolves the compiled calls again."""
    import copy

    layer = make_layer(E=4, H=16, I=8, r=2)
    mod = build_module(layer, dtype=torch.bfloat16)
    twin = copy.deepcopy(mod)
    x, ids, w = make_routing(20, 4, 2, 16, seed=5)
    gy = torch.randn(20, 16, generator=_gen(6), dtype=torch.float64)
    (y0, g0), (y1, g1) = (run_module(m, x.bfloat16(), ids, w.bfloat16(), gy) for m in (mod, twin))
    assert twin.engine.split.native and torch.equal(y0, y1) and torch.equal(g0["x"], g1["x"])


@pytest.mark.parametrize("dtype", DTYPES)
def test_lora_runs_equal_their_reference(dtype: torch.dtype) -> None:
    """``LoraPass.forward_run`` / ``backward_run`` over a run of experts (rows sorted by expert, g_out holding the
    run's rows alone, as the gate_up backward passes it), compiled against Python."""
    lo = _lora(5, 40, 24, 6, seed=3)
    segs = ((1, 10, 27), (2, 27, 27 + 70), (4, 97, 100))  # a run starting at row 10 of 120
    inp = _rand(120, 40, dtype=dtype, seed=1)
    g_run = _rand(90, 48, dtype=dtype, seed=2)  # rows 10..100 only
    w = torch.rand(120, 1, generator=_gen(3)).to(dtype)
    results = []
    for rs in _pair(True):
        lp = LoraPass(lo, dtype, None, rs, Workspace())
        out, a_out = torch.zeros(120, 48, dtype=dtype), torch.zeros(120, 6, dtype=dtype)
        lp.forward_run("gate_up", segs, inp, out, a_out)
        g_in, grads = torch.zeros(120, 40, dtype=dtype), lp.new_grads(zeroed=True)
        lp.backward_run("gate_up", segs, grads, g_run, g_in, inp, a_out, w, g_out_offset=10)
        results.append((out, a_out, g_in, *grads.values()))
    for x, y in zip(*results):
        assert torch.equal(x, y)
    assert not results[1][0][:10].any() and not results[1][0][100:].any()  # rows outside the run untouched
    assert bool(results[1][3][[1, 2, 4]].ne(0).any()) and not bool(results[1][3][[0, 3]].any())


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8_block", "mxfp4"])
def test_quantized_engines_with_run_calls_equal_per_expert_calls(fmt: str, monkeypatch) -> None:
    """Quantized experts with few rows go to the fused kernels: a run of them takes one compiled call
    (``entry.h``'s ``<kernel>_run``) instead of one per expert and projection; forward and every gradient equal
    the per-expert calls' bit for bit (experts above the kernels' row limit stay per expert in both)."""
    from moetune.engine import ExpertEngine
    from moetune.engine.formats import FORMATS
    from moetune.engine.kernels import fused_variant, variant_named
    from moetune.layer import CpuExperts

    spec = variant_named(fused_variant())
    assert spec is not None
    e, h, i = 6, 256, 128  # every format's block sizes divide these
    gen = _gen(5)
    gate_up, down = (
        torch.randn(e, 2 * i, h, generator=gen) / h**0.5,
        torch.randn(e, h, i, generator=gen) / i**0.5,
    )
    weights = FORMATS.get(fmt).from_dense(gate_up, down)
    rows = weights.FUSED_MAX_ROWS.get(spec.name, 0)
    assert rows, f"{fmt} has no fused kernel on {spec.name}"
    t = rows + 40
    x, _, w = make_routing(t, e, 2, h, seed=8)
    # expert 0 in every token's top-2: above the row limit (per expert in both); 1-5 share the rest: below it
    ids = torch.stack([torch.zeros(t, dtype=torch.long), 1 + torch.arange(t) % (e - 1)], dim=1)
    gy = torch.randn(rows + 40, h, generator=_gen(9), dtype=torch.float64)
    lora = _lora(e, h, i, 4, seed=2)
    kernels, (run_name, _) = native_ops(), weights.fused_run_operands("down")
    calls: list[int] = []
    real = getattr(kernels, run_name)

    def counted(*args: object) -> None:
        calls.append(len(args[4]) // 3)  # the experts of the run given to the kernel
        real(*args)

    monkeypatch.setattr(kernels, run_name, counted)
    runs = []
    for native in (False, True):
        tensors = {
            n: t.clone() for n, t in zip(("gate_up_A", "gate_up_B", "down_A", "down_B"), lora.tensors())
        }
        engine = ExpertEngine(
            weights,
            lora=ExpertLoRA(**tensors, scaling=lora.scaling),
            options=EngineOptions(native_ops=native),
        )
        assert engine.compute_dtype == spec.compute and engine.gemm.path.fused_rows == rows
        runs.append(run_module(CpuExperts(engine), x.to(spec.compute), ids, w.to(spec.compute), gy))
    (y0, g0), (y1, g1) = runs
    # the compiled engine's fused experts (1-5, expert 0 being above the limit) went in run calls
    assert calls and sum(calls) >= 4 * 5 and all(0 < c <= 5 for c in calls), calls
    assert torch.equal(y0, y1)
    for name in g0:
        assert torch.equal(g0[name], g1[name]), name
