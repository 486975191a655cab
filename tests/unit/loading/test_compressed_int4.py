"""compressed-tensors' INT4 packing against the package itself (the independent reference), and the int4 format
built from per-expert codes.

``compressed_tensors.compressors.pack_quantized`` is the code that wrote Kimi-K2-Thinking's tensors; its
``pack_to_int32`` / ``unpack_from_int32`` and ``PackedQuantizationCompressor`` define the bytes. moetune's
reader (``loading.quant.compressed_tensors``: ``unpack_codes``, and ``repack`` into the ``int4`` format's
nibble order), the test-checkpoint writer
(``testing.kimi.quantize_int4`` / ``pack_int4`` / ``dequantize_int4``) and ``Int4Experts.from_per_expert``
must agree with them bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from moetune.engine.formats import Int4Experts
from moetune.engine.formats.int4 import pack_codes
from moetune.errors import EngineError
from moetune.loading.quant.compressed_tensors import repack, unpack_codes
from moetune.testing.kimi import dequantize_int4, pack_int4, quantize_int4

ct = pytest.importorskip("compressed_tensors")  # a dev dependency (pyproject's dev extra)
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor  # noqa: E402
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme  # noqa: E402


def scheme(group_size: int = 32) -> QuantizationScheme:
    """Kimi-K2-Thinking's weight scheme, as compressed-tensors' own objects."""
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size)
    return QuantizationScheme(targets=["Linear"], weights=args)


def signed_codes(o: int, d: int, seed: int = 0) -> torch.Tensor:
    """Random int4 codes ``[O, D]`` int8 over the whole signed range, -8 included."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 8, (o, d), generator=gen, dtype=torch.int8)


def int4_layout(u: torch.Tensor) -> torch.Tensor:
    """codes ``[O, D]`` uint8 -> the int4 format's packing ``[O, D/2]`` (its own ``pack_codes``)."""
    out = torch.empty(u.shape[0], u.shape[1] // 2, dtype=torch.uint8)
    pack_codes(u, out)
    return out


@pytest.mark.parametrize(
    ("o", "d"), [(1, 32), (5, 64), (24, 96), (70, 2048)]
)  # 70 rows: several repack chunks
def test_packing_is_compressed_tensors_own(o, d):
    q = signed_codes(o, d)
    packed = pack_to_int32(q, 4)
    assert packed.dtype == torch.int32 and packed.shape == (o, d // 8)
    assert torch.equal(unpack_from_int32(packed, 4, torch.Size((o, d))), q)
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    assert torch.equal(pack_int4(q), packed)  # the test-checkpoint writer
    assert torch.equal(unpack_codes(packed), u)  # moetune's reader
    assert torch.equal(repack(packed), int4_layout(u))  # ... and its re-packing into the int4 format


def test_quantizer_and_decompressor_are_compressed_tensors_own():
    """The writer's codes are those compressed-tensors' compressor makes from the same weight and scales, and
    its dequantization (fp32) is the decompressor's: exactly with fp32 scales, and after the decompressor's
    own bf16 rounding with the bf16 scales as shipped."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(48, 256, generator=gen) * 0.05
    packed, scale = quantize_int4(w)
    assert scale.dtype == torch.bfloat16 and scale.shape == (48, 256 // 32)
    stored = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme())
    assert torch.equal(stored["weight_packed"], packed)
    assert stored["weight_shape"].tolist() == [48, 256]
    codes = unpack_from_int32(packed, 4, torch.Size((48, 256)))
    assert int(codes.min()) == -8 and int(codes.max()) == 7  # the whole range, as real checkpoints use it
    exact = PackedQuantizationCompressor.decompress({**stored, "weight_scale": scale.float()}, scheme())
    assert torch.equal(dequantize_int4(packed, scale), exact["weight"])
    shipped = PackedQuantizationCompressor.decompress(stored, scheme())["weight"]  # bf16: q * s rounded once
    assert shipped.dtype == torch.bfloat16 and torch.equal(dequantize_int4(packed, scale).bfloat16(), shipped)


def test_int4_from_per_expert_dequantizes_to_q_times_s():
    e, h, i = 3, 64, 32
    gen = torch.Generator().manual_seed(2)
    mats = {"gate": (i, h), "up": (i, h), "down": (h, i)}
    q = {p: [signed_codes(*s, seed=10 * x + n) for x in range(e)] for n, (p, s) in enumerate(mats.items())}
    s = {
        p: [torch.rand(o, d // 32, generator=gen).bfloat16() for _ in range(e)] for p, (o, d) in mats.items()
    }
    packed = {p: [repack(pack_to_int32(c, 4)) for c in q[p]] for p in mats}
    fmt = Int4Experts.from_per_expert(
        packed["gate"], s["gate"], packed["up"], s["up"], packed["down"], s["down"], group_size=32
    )
    assert fmt.symmetric and fmt.group_size == 32 and fmt.nbytes == e * 3 * h * i * (0.5 + 2 / 32)
    gate_up, down = fmt.dequantize(torch.float32)
    for x in range(e):
        want = {p: q[p][x].float() * s[p][x].float().repeat_interleave(32, dim=1) for p in mats}
        assert torch.equal(gate_up[x, :i], want["gate"])
        assert torch.equal(gate_up[x, i:], want["up"])
        assert torch.equal(down[x], want["down"])


def test_int4_from_per_expert_rejects_bad_tensors():
    h, i = 64, 32
    good = {
        "gate": [torch.zeros(i, h // 2, dtype=torch.uint8)],
        "gate_scale": [torch.ones(i, h // 32, dtype=torch.bfloat16)],
        "up": [torch.zeros(i, h // 2, dtype=torch.uint8)],
        "up_scale": [torch.ones(i, h // 32, dtype=torch.bfloat16)],
        "down": [torch.zeros(h, i // 2, dtype=torch.uint8)],
        "down_scale": [torch.ones(h, i // 32, dtype=torch.bfloat16)],
    }
    with pytest.raises(
        EngineError, match=r"up\[0\] must be torch.uint8 \[I, H/2\] = \(32, 32\); got torch.int32"
    ):
        Int4Experts.from_per_expert(
            **{**good, "up": [torch.zeros(i, h // 8, dtype=torch.int32)]}, group_size=32
        )
    with pytest.raises(EngineError, match=r"down_scale\[0\] must be torch.bfloat16 \[H, I/g\]"):
        Int4Experts.from_per_expert(**{**good, "down_scale": [torch.ones(h, 1)]}, group_size=32)
    with pytest.raises(EngineError, match="every list needs one tensor per expert"):
        Int4Experts.from_per_expert(**{**good, "down": []}, group_size=32)
