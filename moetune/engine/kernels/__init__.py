"""Compiled kernels for the expert engine, built on first use; the torch path stays the reference and fallback.

``fused_gemm.cpp``: GEMMs that read int8 / int4 expert codes from memory and dequantize them in registers
into bf16 AMX tiles (``load_fused`` returns the built module, or None when this machine cannot build or run
it; ``moetune.engine.gemm`` routes experts with few rows to it).
"""

from moetune.engine.kernels.loader import (
    KERNELS_ENV,
    check_kernels_env,
    fused_kernels,
    fused_unavailable,
    load_fused,
)

__all__ = ["KERNELS_ENV", "check_kernels_env", "fused_kernels", "fused_unavailable", "load_fused"]
