"""Expert weight formats behind one contract (:class:`ExpertFormat`); see ``FORMATS`` for the registered ones.

``dense`` (bf16/fp16/fp32/fp64 as given), ``int8`` (per-channel), ``int4`` (group-wise, packed),
``fp8_block`` (e4m3 with 128 x 128 block scales) and ``mxfp4`` (e2m1 with an e8m0 scale per 32, gpt-oss's
shipped format); docs/formats.md compares them.
"""

from moetune.engine.formats.base import FORMATS, ExpertFormat
from moetune.engine.formats.dense import DenseExperts
from moetune.engine.formats.fp8_block import Fp8BlockExperts
from moetune.engine.formats.int4 import Int4Experts
from moetune.engine.formats.int8 import Int8Experts
from moetune.engine.formats.mxfp4 import Mxfp4Experts

__all__ = [
    "FORMATS",
    "DenseExperts",
    "ExpertFormat",
    "Fp8BlockExperts",
    "Int4Experts",
    "Int8Experts",
    "Mxfp4Experts",
]
