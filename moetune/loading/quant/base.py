"""The contract of a quantized-checkpoint method (``QuantMethod``), the tensors of one quantized weight
(``QuantizedWeight``) and what the methods share.

A method is chosen by ``config.json``'s ``quantization_config.quant_method`` (``QUANT_METHODS``; the lookup
is ``quant.checkpoint_quantization``, which also checks the method's ``model_types``) and does four things:

1. ``from_config``: validates the quantization config. A field moetune cannot hold as shipped is a
   ``LoadError`` naming the field, its value and what is supported, raised before any tensor is read.
2. ``pair``: from the safetensors headers only, gathers each quantized weight's stored tensors (codes,
   scales, ...) into a ``QuantizedWeight``, reported under its *logical* key with the shape of the float
   tensor it stands for: ``<name>.weight [O, D]`` for a ``Linear``, or a fused experts tensor
   (``experts.gate_up_proj``, ``experts.down_proj``) in the module's run-time shape. The expert plan and
   transformers' key mapping then see the names and shapes of a float checkpoint; ``logical_tensors``
   builds that view.
3. ``read_experts``: one layer's routed experts, by role (``ROLES`` per expert, or the fused tensor names;
   which ones a method reads, ``expert_problem`` says at planning), into the engine format the method
   holds them in as stored (``native``): the checkpoint's codes and scales, never a float round trip. Only
   the experts asked for are read (a rank's share under ``expert_parallel: sharded``): the per-expert
   weights of the others are not passed in, and a fused tensor is read one asked-for expert slice at a time.
4. ``dequantize``: any other quantized weight (attention, dense MLPs ...) to fp32 ``[O, D]``; it reaches
   transformers' loader as a plain tensor (``Dequantized``), so the torch model is a float one. A method
   whose weights are routed experts' only (``experts_only``) has its other weights refused at planning.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

import torch

from moetune.arch.detect import ExpertsLayout, ExpertsSite
from moetune.engine.formats.base import ExpertFormat
from moetune.errors import LoadError, listing
from moetune.loading.checkpoint import Checkpoint, ShardReader, TensorInfo
from moetune.loading.options import ExpertFormatChoice
from moetune.registry import Registry

ROLES = ("gate", "up", "down")  # a per-expert matrix's role in its expert: gate/up [I, H], down [H, I]
T = TypeVar("T")


@dataclass(frozen=True)
class QuantizedWeight:
    """One quantized ``Linear`` weight as a checkpoint stores it.

    ``info`` is the logical ``<name>.weight``: its float shape ``[O, D]``, the shard of its main tensor, and
    the method's ``code`` as dtype. ``parts`` are the stored tensors by role, the main one (which messages
    name) first (FP8: ``weight``, ``scale_inv``; compressed-tensors: ``packed``, ``scale``, ``shape``; MXFP4:
    ``blocks``, ``scales``).
    """

    info: TensorInfo
    parts: Mapping[str, TensorInfo]

    @property
    def key(self) -> str:
        return self.info.key

    @property
    def main(self) -> TensorInfo:
        """The stored tensor that holds the weight's codes, as messages name it."""
        return next(iter(self.parts.values()))

    @property
    def files(self) -> set[str]:
        return {t.file for t in self.parts.values()}

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.parts.values())


class QuantMethod(ABC):
    """One ``quant_method``: a validated quantization config and how to read its tensors.

    Subclasses register in ``QUANT_METHODS`` under their ``quant_method`` value.
    """

    name: ClassVar[str]  # its quant_method value, the registry name
    label: ClassVar[str]  # what messages call its weights ("FP8", "compressed-tensors INT4")
    code: ClassVar[str]  # the dtype its logical weights report (a safetensors code or the method's own)
    supported: ClassVar[str]  # one line: what of this method moetune loads, for the no-match error
    declaration: ClassVar[str]  # the quantization_config its checkpoints declare, for messages
    model_types: ClassVar[tuple[str, ...]] = ()  # the config model_types it reads (empty: any)
    experts_only: ClassVar[bool] = False  # quantizes routed experts only: a weight elsewhere is refused
    writes: ClassVar[bool] = False  # quantize() writes merged weights back in the method's format

    @classmethod
    @abstractmethod
    def from_config(cls, quant: Mapping[str, Any], where: str) -> QuantMethod:
        """The method for ``quantization_config`` ``quant`` (``where`` names it in messages); ``LoadError``
        naming any field moetune cannot hold as shipped."""

    @classmethod
    @abstractmethod
    def undeclared(cls, checkpoint: Checkpoint) -> list[str]:
        """``"<file>: <key> is ..."`` for each tensor only this method's checkpoints hold: a problem wherever
        config.json does not declare this method."""

    @abstractmethod
    def pair(self, checkpoint: Checkpoint) -> tuple[dict[str, QuantizedWeight], list[str]]:
        """Logical key -> its ``QuantizedWeight``, and every problem found (missing, orphaned, misshapen or
        mistyped parts), each naming the file and key. Headers only."""

    @property
    @abstractmethod
    def native(self) -> ExpertFormatChoice:
        """The engine format (and options) routed experts are held in as stored."""

    def expert_problem(self, weight: QuantizedWeight, role: str, site: ExpertsSite) -> str | None:
        """Why ``weight`` cannot be ``role`` of the experts at ``site``, held natively (None: it can): the whole
        message, naming the file and key. Checked at planning, before the plan checks the logical shape.

        ``role`` is ``gate``/``up``/``down`` for one expert's matrix or a fused tensor's name (``gate_up_proj``,
        ``down_proj``). The default reads per-expert matrices only.
        """
        if role in ROLES:
            return None
        return (
            f"{weight.info.file}: expert tensor {weight.key} is a fused {self.label} tensor; moetune reads "
            f"{self.label} experts stored per expert ({{e}}.gate_proj/up_proj/down_proj), as DeepSeek-V3 and "
            "Kimi-K2 do"
        )

    @abstractmethod
    def read_experts(
        self,
        weights: Mapping[str, Sequence[QuantizedWeight]],
        layout: ExpertsLayout,
        reader: ShardReader,
        experts: range,
    ) -> ExpertFormat:
        """Experts ``experts`` (global ids, consecutive: every expert of the layer, or a rank's share) of one
        layer in ``native``'s format, ``experts.start`` at index 0. ``weights`` maps each role
        ``expert_problem`` accepted to its weights: per expert, ``gate``/``up`` ``[I, H]`` and ``down``
        ``[H, I]``, those of ``experts`` only, in expert order; fused, ``gate_up_proj`` and ``down_proj``, one
        each, of which only the slices of ``experts`` may be read."""

    @abstractmethod
    def dequantize(self, weight: QuantizedWeight, reader: ShardReader) -> torch.Tensor:
        """``weight`` as fp32 ``[O, D]``, by the method's definition (never asked of an ``experts_only`` method:
        the plan refuses its weights outside routed experts)."""

    def dequantize_parts(
        self, weight: QuantizedWeight, parts: Mapping[str, torch.Tensor], out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``weight`` as fp32 from its stored ``parts`` in hand (``{part: tensor}``; a fused expert tensor's may be
        one expert's slices, giving that expert's ``[D, O]``): what ``dequantize`` computes after reading them,
        written into ``out`` (fp32, the result's shape; returned) when given. Only methods that set ``writes``
        (``moetune.export.merge`` reads merged weights back with it, into buffers it reuses)."""
        raise LoadError(f"{weight.key}: moetune reads no {self.label} weights from parts in hand")

    def quantize(self, weight: QuantizedWeight, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """``w`` (fp32, ``weight``'s logical shape, or one expert's slice of a fused expert tensor) in ``weight``'s
        stored form: ``{part: tensor}`` for every part that changes, each of that part's dtype and shape (its
        expert slice) (a merged weight written back into the checkpoint's format: ``moetune.export.merge``). Only
        methods that set ``writes``; the merge refuses the others."""
        raise LoadError(f"{weight.key}: moetune writes no {self.label} weights")


QUANT_METHODS: Registry[type[QuantMethod]] = Registry("quantization method")


def raise_problems(checkpoint: Checkpoint, label: str, problems: list[str]) -> None:
    """One ``LoadError`` listing ``problems`` (``errors.listing``) with the weights of ``label``."""
    if problems:
        raise LoadError(
            f"checkpoint {checkpoint.path}: {len(problems)} problem(s) with {label} weights or their "
            f"scales:{listing(problems)}"
        )


def logical_tensors(checkpoint: Checkpoint, weights: Mapping[str, QuantizedWeight]) -> dict[str, TensorInfo]:
    """The checkpoint's tensors as a float checkpoint would name them: every quantized weight's parts
    replaced by its logical ``<name>.weight``, in the position of its first part."""
    part_of = {p.key: w for w in weights.values() for p in w.parts.values()}
    out: dict[str, TensorInfo] = {}
    for key, info in checkpoint.tensors.items():
        weight = part_of.get(key)
        if weight is None:
            out[key] = info
        elif weight.key not in out:
            out[weight.key] = weight.info
    return out


class LazyTensors(Sequence[torch.Tensor], Generic[T]):
    """``load(items[i])`` on indexing, so a consumer walking the sequence (``from_per_expert``) holds one
    tensor read from the checkpoint at a time. The last one read is kept until the next index is asked for
    (``from_per_expert`` reads item 0's shape before it copies item 0, which is then not read twice), except
    the final item's, so that nothing stays held once the consumer has walked the sequence."""

    def __init__(self, items: Sequence[T], load: Callable[[T], torch.Tensor]) -> None:
        self.items, self.load = items, load
        self._last: tuple[int, torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i):  # type: ignore[override]  # int indices only: from_per_expert's use
        if self._last is not None and self._last[0] == i:
            return self._last[1]
        self._last = None  # the previous tensor is released before the next is read
        out = self.load(self.items[i])
        if i != len(self.items) - 1:
            self._last = (i, out)
        return out


class Dequantized:
    """Stands in for a lazy safetensors slice of a quantized weight: indexing reads its parts and returns
    the dequantized fp32 tensor, which transformers' loader then casts to the load dtype."""

    def __init__(self, method: QuantMethod, weight: QuantizedWeight, reader: ShardReader) -> None:
        self.method, self.weight, self.reader = method, weight, reader

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.method.dequantize(self.weight, self.reader)[index]
