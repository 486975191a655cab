"""NaN/Inf scan of routed-expert weights as they are streamed in (``load_model`` and ``moetune convert``).

A non-finite expert weight poisons every token routed to that expert, and quantizing hides it: int8's
per-row ``amax`` skips NaN, so a store converted from NaN weights looked valid. So each layer's tensors are
checked right after they are read from the checkpoint, before any quantization, while they are still in
memory (one more pass over one layer: cheap next to reading it). Each tensor is checked whole by
``moetune.finite.all_finite`` (one min/max reduction, no temporary, on torch's intra-op threads), and only a
tensor found bad is searched one expert at a time for the expert to name. Against the per-expert fp32 sums
it replaced (``python bench/finite.py``, a layer of 16 experts, one thread of a Zen 4, two runs): bf16 5.9-7.7 ->
17.4-17.5 GB/s, FP8 codes 0.3 -> 12.7-13.4 GB/s, fp32 level at memory speed. Only floating-point tensors are
scanned (a quantized layer's codes are checked by its format's constructor, its scales and biases here).
The first bad expert found is a ``NonFiniteWeightError`` naming the checkpoint file, the tensor, the layer,
the expert and how many values are NaN or Inf.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from moetune.arch.detect import DOWN, DOWN_BIAS, GATE_UP, GATE_UP_BIAS
from moetune.errors import NonFiniteError, NonFiniteWeightError
from moetune.finite import all_finite, first_non_finite, non_finite_mask
from moetune.loading.expert_plan import LayerPlan

_ADVICE = (
    "The checkpoint is damaged or was saved from a diverged run: re-download or re-export it (moetune refuses "
    "it rather than train or convert on NaN)"
)
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
        if t is None or not t.is_floating_point() or all_finite(t):
            continue
        bad = first_non_finite(t)  # the expert to name
        assert bad is not None
        _refuse(layer, name, first + bad, t[bad], non_finite_mask(t[bad]))


def _refuse(layer: LayerPlan, name: str, expert: int, values: torch.Tensor, bad: torch.Tensor) -> None:
    nan = int(torch.isnan(values.float()).sum())  # fp32 holds every 8/16-bit value; isnan takes no float8
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
        f"{named}; expert weights must be finite. {_ADVICE}"
    )


def damaged_quantized(layer: LayerPlan, experts: range, err: NonFiniteError) -> NonFiniteWeightError:
    """The error for a quantized layer whose format refused its stored codes or scales (``err``, which names the
    format's field and expert index): the layer, the experts read and the files they came from added."""
    files = sorted({s.info.file for s in layer.sources if s.expert is None or s.expert in experts})
    base = f"; index 0 is the layer's expert {experts.start}" if experts.start else ""
    return NonFiniteWeightError(
        f"routed-expert weights of {layer.site.path} (read from {', '.join(files)}{base}): {err}. {_ADVICE}"
    )
