"""Compiled kernels for the expert engine, built on first use; the torch path stays the reference and fallback.

GEMMs that read int8 / int4 / fp8_block / mxfp4 expert codes from memory and dequantize them in registers
(``decoders.h``), in one variant per ISA behind a registry (``VARIANTS``, best first: ``amx_gemm.cpp`` on
AMX-BF16 tiles, ``avx512_gemm.cpp`` on AVX512-BF16 dot products, both in bf16; ``avx2_gemm.cpp`` on AVX2 + FMA in
fp32), with one Python API (``entry.h``).
``load_fused`` returns the best variant's built module that runs here, or None
(``fused_unavailable`` says why; ``fused_variant`` names it; ``load_variant`` builds one by name); ``moetune.engine.gemm`` routes experts with few
rows to it.
"""

from moetune.engine.kernels.loader import (
    KERNELS_ENV,
    VARIANTS,
    KernelVariant,
    a8_kernel,
    check_kernels_env,
    fused_kernels,
    fused_unavailable,
    fused_variant,
    int8_rows_formats,
    kernels_disabled,
    load_fused,
    load_variant,
    variant_named,
)

__all__ = [
    "KERNELS_ENV",
    "VARIANTS",
    "KernelVariant",
    "a8_kernel",
    "check_kernels_env",
    "fused_kernels",
    "fused_unavailable",
    "fused_variant",
    "int8_rows_formats",
    "kernels_disabled",
    "load_fused",
    "load_variant",
    "variant_named",
]
