"""NaN/Inf scan of routed-expert weights as they are streamed in (``load_model`` and ``moetune convert``).

A non-finite expert weight poisons every token routed to that expert, and quantizing hides it: int8's
per-row ``amax`` skips NaN, so a store converted from NaN weights looked valid. So each layer's tensors are
checked right after they are read from the checkpoint, before any quantization, while they are still in
memory (one more pass over one layer: cheap next to reading it). The check goes one expert at a time: a sum
in fp32 (no temporary; NaN and Inf propagate into it), and only for an expert whose sum is not finite the
exact element-wise check (its temporary is one expert's ``[out, in]`` mask). Measured on one thread of a
shared Xeon: 1.6 GB/s for bf16 and 4.6 GB/s for fp32 weights (``isfinite`` itself: 0.3-0.4 GB/s); torch's
intra-op pool runs the sums on every engine thread. Only floating-point tensors are
scanned (a quantized layer's codes are checked by its format's constructor, its scales and biases here).
The first bad expert found is a ``NonFiniteWeightError`` naming the checkpoint file, the tensor, the layer,
the expert and how many values are NaN or Inf.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from moetune.arch.detect import DOWN, DOWN_BIAS, GATE_UP, GATE_UP_BIAS
from moetune.errors import NonFiniteWeightError
from moetune.loading.expert_plan import LayerPlan

# which checkpoint roles feed each engine tensor (the format's state fields share the first word)
_ROLES = {
    "gate_up": ("gate", "up", GATE_UP),
    "down": ("down", DOWN),
    "gate_up_bias": (GATE_UP_BIAS,),
    "down_bias": (DOWN_BIAS,),
}


def check_finite_layer(layer: LayerPlan, tensors: Mapping[str, torch.Tensor | None], first: int = 0) -> None:
    """``NonFiniteWeightError`` if a floating tensor of ``tensors`` holds NaN or Inf.

    ``tensors``: what was read for ``layer``, each ``[E, ...]`` with the expert first, by engine name
    (``gate_up`` ``[E, 2I, H]``, ``down`` ``[E, H, I]``, ``gate_up_bias`` ``[E, 2I]``, ``down_bias`` ``[E, H]``,
    or a quantized format's state fields such as ``gate_up_scale_inv``); None entries are skipped. ``first``: the
    layer's expert id of index 0 (a rank's share of the experts, ``expert_parallel: sharded``), for the message.
    """
    for name, t in tensors.items():
        if t is None or not t.is_floating_point():
            continue
        wide = torch.float64 if t.dtype == torch.float64 else torch.float32
        for e in range(t.shape[0]):
            # fast path: a NaN or Inf makes the sum non-finite (inf - inf is NaN); finite values that overflow
            # the fp32 sum only send this expert to the exact check. Measured 4-10x faster than isfinite().
            if bool(torch.isfinite(t[e].sum(dtype=wide))):
                continue
            bad = ~torch.isfinite(t[e])
            if bool(bad.any()):
                _refuse(layer, name, first + e, t[e], bad)


def _refuse(layer: LayerPlan, name: str, expert: int, values: torch.Tensor, bad: torch.Tensor) -> None:
    nan = int(torch.isnan(values).sum())
    inf = int(bad.sum()) - nan
    base = max((k for k in _ROLES if name == k or name.startswith(k + "_")), key=len, default="")
    roles = set(_ROLES.get(base, ()))
    if name == "gate_up":  # the engine keeps gate rows first: the first bad row says gate or up
        row = int(bad.nonzero()[0][0])
        roles -= {"up"} if row < layer.site.layout.intermediate_size else {"gate"}
    sources = [s for s in layer.sources if s.role in roles and s.expert in (None, expert)]
    named = ", ".join(f"{s.info.key} in {s.info.file}" for s in sources) or f"the checkpoint's {name}"
    raise NonFiniteWeightError(
        f"routed-expert weights of {layer.site.path} (expert {expert}) hold {nan} NaN and {inf} Inf value(s) in "
        f"{named}; expert weights must be finite. The checkpoint is damaged or was saved from a diverged "
        "run: re-download or re-export it (moetune refuses it rather than train or convert on NaN)"
    )
