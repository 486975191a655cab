"""Which checkpoint tensors feed which experts module, checked from headers before anything is read.

Each checkpoint key is first mapped by transformers' own rules for the model (``hf.checkpoint_targets``:
e.g. Mixtral's ``block_sparse_moe`` -> ``mlp``, a missing ``model.`` prefix, per-expert keys merged into
``experts.gate_up_proj``); a key whose target lies inside an experts module is an expert tensor of that
module, every other key loads through transformers. Where transformers splits one list of per-expert keys
over several experts modules (ERNIE-4.5-VL: ``experts.{0..E-1}`` text, ``experts.{E..2E-1}`` vision), each key
goes to the module its index falls in, renumbered within it. An expert tensor is then read from its renamed (not
yet merged) name, in one of the on-disk layouts:

    per expert   ``experts.{e}.gate_proj/up_proj/down_proj.weight`` (or Mixtral's ``w1/w3/w2``, dots.3's
                 vision ``fc1/fc3/fc2``), each
                 ``[out, in]``: gate/up ``[I, H]``, down ``[H, I]``
    fused        ``experts.gate_up_proj`` / ``experts.down_proj`` (+ ``_bias``) in the module's layout,
                 or with the last two dimensions swapped (Qwen3-VL stores ``[E, H, 2I]`` for ``[E, 2I, H]``),
                 told apart by shape as transformers does (the runtime layout wins when H = 2I)

In quantized checkpoints (``loading.quant``: FP8 block-scaled, compressed-tensors INT4, MXFP4) the plan sees
each quantized weight under its logical key and float shape (``quant.logical_tensors``): ``<name>.weight``
per expert, or a fused ``gate_up_proj`` / ``down_proj`` (gpt-oss's MXFP4). A layer's expert matrices may all
be quantized weights of the checkpoint's method, which says at planning whether it reads them in that role
and layout (``QuantMethod.expert_problem``); their stored tensors (codes, scales) travel with them
(``ExpertSource.quantized``) and are read by that method (``LayerPlan.method``), fused biases as float
tensors beside them. Layers mixing quantized and float expert matrices are not read, nor quantized weights
of an ``experts_only`` method outside routed experts.

Every layer must have exactly one complete set; anything missing, extra, misshapen or not floating point
is a ``LoadError`` naming the file and key.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

import torch

from moetune.arch.detect import DOWN, DOWN_BIAS, GATE_UP, GATE_UP_BIAS, UP, ExpertsSite
from moetune.errors import LoadError, listing
from moetune.loading.checkpoint import Checkpoint, TensorInfo
from moetune.loading.hf import KeyTarget
from moetune.loading.quant import QUANT_METHODS, ROLES, QuantizedWeight, QuantMethod

# dense formats the engine stores as they are, widest first
FLOAT_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# On-disk per-expert projection names, one naming scheme per tuple (gate, up, down).
PER_EXPERT_SCHEMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"), ("fc1", "fc3", "fc2"))
_ROLE_OF = {name: role for scheme in PER_EXPERT_SCHEMES for name, role in zip(scheme, ROLES)}
_FUSED = (GATE_UP, UP, DOWN, GATE_UP_BIAS, DOWN_BIAS)


@dataclass(frozen=True)
class ExpertSource:
    """One checkpoint tensor feeding an experts module.

    ``role`` is ``gate``/``up``/``down`` for a per-expert matrix (``expert`` set) or for one projection of
    every expert stacked ``[E, out, in]`` (``expert`` None), or a fused tensor name (``gate_up_proj``,
    ``down_proj``, ``gate_up_proj_bias``, ``down_proj_bias``; ``expert`` None).
    ``swapped``: a fused 3-D tensor stored with its last two dimensions swapped relative to the module, or a
    stacked projection whose per-expert matrices are stored ``[in, out]`` (DBRX's flat down projection).
    ``interleaved``: a fused gate_up (or its bias) stored with gate and up interleaved along 2I.
    ``stem``: the key up to the experts container (``model.layers.0.block_sparse_moe.experts.``), as stored;
    ``proj``: a per-expert tensor's projection name (``gate_proj``, ``w1``, ...), for messages.
    ``quantized``: a quantized matrix's stored tensors (``info`` is then its logical weight: ``[out, in]``
    per expert, the run-time shape fused); None for a float one.
    """

    info: TensorInfo
    role: str
    expert: int | None = None
    swapped: bool = False
    interleaved: bool = False
    stem: str = ""
    proj: str = ""
    quantized: QuantizedWeight | None = None

    @property
    def stored(self) -> list[TensorInfo]:
        """The checkpoint tensors this source reads."""
        return [self.info] if self.quantized is None else list(self.quantized.parts.values())


@dataclass
class LayerPlan:
    """The tensors of one experts module, validated complete. ``method``: the quantization method that reads
    its expert matrices when they are quantized (all of them: never mixed; fused biases stay float), else
    None."""

    site: ExpertsSite
    sources: list[ExpertSource] = field(default_factory=list)
    method: QuantMethod | None = None

    @property
    def files(self) -> list[str]:
        return sorted({t.file for s in self.sources for t in s.stored})

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for s in self.sources for t in s.stored)

    def read_nbytes(self, experts: range | None) -> int:
        """The checkpoint bytes a load of ``experts`` reads (None: every expert, ``nbytes``): the per-expert
        tensors of those experts, and their share of every fused or stacked tensor (its experts are of equal
        size)."""
        if experts is None:
            return self.nbytes
        e = self.site.layout.num_experts
        return sum(
            t.nbytes * len(experts) // e if s.expert is None else t.nbytes * (s.expert in experts)
            for s in self.sources
            for t in s.stored
        )

    @property
    def float_dtype(self) -> torch.dtype:
        """The widest float dtype the checkpoint stores this layer's expert tensors in (quantized: fp32)."""
        codes = {s.info.dtype for s in self.sources}
        return next((t for code, t in FLOAT_DTYPES.items() if code in codes), torch.float32)


@dataclass
class ExpertPlan:
    """Expert layers in reading order, and the (logical) checkpoint keys left for transformers to load."""

    layers: list[LayerPlan]
    other_keys: list[str]

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)


def _site_of(target: str, sites: dict[str, ExpertsSite]) -> ExpertsSite | None:
    """The experts module whose path is a dotted prefix of ``target``."""
    parts = target.split(".")
    for n in range(len(parts) - 1, 0, -1):
        site = sites.get(".".join(parts[:n]))
        if site is not None:
            return site
    return None


class _Problems:
    """Collects every problem of a plan, raised as one ``LoadError``."""

    def __init__(self) -> None:
        self.items: list[str] = []

    def add(self, message: str) -> None:
        self.items.append(message)

    def raise_if_any(self, root: str) -> None:
        if not self.items:
            return
        raise LoadError(
            f"checkpoint {root}: {len(self.items)} problem(s) with the routed-expert tensors:{listing(self.items)}"
        )


def _split_site(
    dest: KeyTarget, site: ExpertsSite, sites: dict[str, ExpertsSite]
) -> tuple[ExpertsSite, str] | str:
    """For a per-expert key of a list transformers splits over several experts modules (``dest.split``, equal
    consecutive ranges in target order): the module its expert index falls in, and the key renamed with the
    index within that module; or why not."""
    attr = re.escape(site.path.rpartition(".")[2])
    m = re.search(rf"((?:^|\.){attr}\.)(\d+)(\.\w+\.weight)$", dest.renamed)
    split = [_site_of(t, sites) for t in dest.split]
    if m is None or any(s is None for s in split):
        return f"split over {list(dest.split)}, which are not all experts modules"
    e, size = int(m.group(2)), site.layout.num_experts
    if e >= size * len(split):
        return f"expert index {e} out of range ({len(split)} modules of E = {size})"
    part = split[e // size]
    assert part is not None
    return part, f"{dest.renamed[: m.start()]}{m.group(1)}{e % size}{m.group(3)}"


def _stem(key: str, renamed: str, suffix: str) -> str:
    """``key`` without ``suffix`` (the part after the experts container), falling back to the renamed key."""
    return key[: -len(suffix)] if key.endswith(suffix) else renamed[: -len(suffix)]


def _parse(info: TensorInfo, renamed: str, site: ExpertsSite, dest: KeyTarget) -> ExpertSource | str | None:
    """An ``ExpertSource`` for ``info`` (named ``renamed`` after transformers' renamings, loading into
    ``dest``) in ``site``, why it is not an expert tensor of it, or None for a tensor nothing computes with
    (a zero-computation expert's gate/up rows, LongCat-Flash)."""
    attr = re.escape(site.path.rpartition(".")[2])
    lay = site.layout
    i, h = lay.intermediate_size, lay.hidden_size
    if lay.flat is not None:
        return _parse_flat(info, renamed, site)
    per_expert = re.search(rf"(?:^|\.){attr}\.((\d+)\.(\w+)\.weight)$", renamed)
    if per_expert:
        e, name = int(per_expert.group(2)), per_expert.group(3)
        if name not in _ROLE_OF:
            return f"unknown expert projection {name!r} (known: {', '.join(sorted(_ROLE_OF))})"
        role = _ROLE_OF[name]
        if role not in _roles(lay.gated):
            return f"a {role} projection ({name}), but the model's experts are not gated (up and down only)"
        if lay.num_experts <= e < lay.num_experts + lay.identity_experts and role != "down":
            return None
        if e >= lay.num_experts:
            return f"expert index {e} out of range (E = {lay.num_experts})"
        want: tuple[int, ...] = (h, i) if role == "down" else (i, h)
        if info.shape != want:
            return f"shape {info.shape}, expected {want} ({role} of expert {e}, [out, in])"
        return ExpertSource(info, role, e, stem=_stem(info.key, renamed, per_expert.group(1)), proj=name)
    into = dest.target.rpartition(".")[2]  # the module tensor transformers builds from it
    stacked = re.search(r"\.(\w+)\.weight$", renamed)
    if into in (GATE_UP, UP, DOWN) and stacked and stacked.group(1) in _ROLE_OF:
        role = _ROLE_OF[stacked.group(1)]
        want = (lay.num_experts, h, i) if role == "down" else (lay.num_experts, i, h)
        if info.shape != want:
            return f"shape {info.shape}, expected {want} ({role} of every expert, [E, out, in])"
        return ExpertSource(
            info, role, stem=_stem(info.key, renamed, stacked.group(0)[1:]), proj=stacked.group(1)
        )
    fused = re.search(rf"(?:^|\.){attr}\.(\w+)$", renamed)
    name = fused.group(1) if fused else None
    if name not in _FUSED and dest.converted and into in _FUSED:
        name = into
    if name is None or name not in _FUSED:
        return (
            "not an expert tensor name moetune reads (per expert: {e}.gate_proj/up_proj/down_proj.weight, "
            "{e}.w1/w3/w2.weight or {e}.fc1/fc3/fc2.weight; stacked: gate_proj/up_proj/down_proj.weight "
            "[E, out, in]; fused: gate_up_proj (non-gated experts: up_proj), down_proj, gate_up_proj_bias, "
            "down_proj_bias)"
        )
    if name not in lay.tensor_names:
        return f"{name}, which the model's experts do not have (they have {', '.join(lay.tensor_names)})"
    stem = _stem(info.key, renamed, fused.group(1) if fused else name)
    # stored interleaved: the module's order, flipped where transformers' converter interleaves on load
    interleaved = name in (GATE_UP, GATE_UP_BIAS) and lay.interleaved != ("Interleave" in dest.ops)
    want = lay.runtime_shape(name)
    if info.shape == want:
        return ExpertSource(info, name, interleaved=interleaved, stem=stem)
    swapped = (*want[:-2], want[-1], want[-2])
    if len(want) == 3 and info.shape == swapped:
        return ExpertSource(info, name, swapped=True, interleaved=interleaved, stem=stem)
    alt = f" or {swapped}" if len(want) == 3 else ""
    return f"shape {info.shape}, expected {want}{alt}"


def _roles(gated: bool) -> tuple[str, ...]:
    """The projections an expert has: gate, up and down, or up and down for non-gated experts."""
    return ROLES if gated else tuple(r for r in ROLES if r != "gate")


def _parse_flat(info: TensorInfo, renamed: str, site: ExpertsSite) -> ExpertSource | str:
    """A flat ``[E*I, H]`` projection of every expert (``ExpertsLayout.flat``: DBRX's ``mlp.w1/v1/w2``), read as
    one projection stacked ``[E, I, H]``: the same bytes, expert e's block its e-th slice; the down projection
    is stored transposed (``swapped``)."""
    lay = site.layout
    assert lay.flat is not None
    tails = dict(zip(lay.flat.names, ROLES))
    tail = next((t for t in tails if renamed.endswith(f"{site.path.rpartition('.')[2]}.{t}")), None)
    if tail is None:
        return f"not one of the flat expert tensors {', '.join(lay.flat.names)}"
    want = lay.runtime_shape(tail)
    if info.shape != want:
        return f"shape {info.shape}, expected {want} (flat [E*I, H])"
    stacked = dataclasses.replace(info, shape=(lay.num_experts, lay.intermediate_size, lay.hidden_size))
    role = tails[tail]
    return ExpertSource(stacked, role, swapped=role == "down", stem=renamed[: -len(tail)], proj=tail)


def _missing(layer: LayerPlan) -> list[str]:
    """What ``layer`` still lacks, each with the key expected (named like the layer's own keys)."""
    site, lay = layer.site, layer.site.layout
    fused = [s for s in layer.sources if s.expert is None]
    per = [s for s in layer.sources if s.expert is not None]
    if fused and per:
        return [
            f"{site.path}: mixes per-expert keys ({per[0].info.key}) with fused ones ({fused[0].info.key})"
        ]
    if not layer.sources:
        return [
            f"{site.path}: no expert tensors at all (E = {lay.num_experts}); expected per-expert keys like "
            f"{site.path}.0.gate_proj.weight or fused {site.path}.{GATE_UP}"
        ]
    stem = layer.sources[0].stem
    where = f"the layer's other expert tensors are in {', '.join(layer.files)}"
    if fused:
        have = {s.role for s in fused}
        have |= {GATE_UP} if {"gate", "up"} <= have else set()  # stacked projections build the fused tensors
        have |= {UP} if "up" in have else set()
        have |= (
            {n for n, role in zip(lay.flat.names, ROLES) if role in have} if lay.flat is not None else set()
        )
        have |= {DOWN} if "down" in have else set()
        return [f"missing {stem}{n} ({site.path}; {where})" for n in lay.tensor_names if n not in have]
    scheme = next(s for s in PER_EXPERT_SCHEMES if per[0].proj in s)
    have_pe = {(s.expert, s.role) for s in per}
    out = [
        f"missing {stem}{e}.{name}.weight ({role} of expert {e} of {site.path}; {where})"
        for e in range(lay.num_experts)
        for role, name in zip(ROLES, scheme)
        if role in _roles(lay.gated) and (e, role) not in have_pe
    ]
    if lay.has_bias:
        out.append(
            f"{site.path}: per-expert checkpoints carry no expert biases, but the model's experts have them"
        )
    return out


def _mixed(layer: LayerPlan, method: QuantMethod | None) -> list[str]:
    """A layer whose expert matrices are partly quantized and partly float (biases, always float, aside): one
    example of each, the quantized one by its stored key."""
    matrices = [s for s in layer.sources if s.role not in (GATE_UP_BIAS, DOWN_BIAS)]
    quantized = [s.quantized for s in matrices if s.quantized is not None]
    dense = [s for s in matrices if s.quantized is None]
    if method is not None and quantized and dense:
        return [
            f"{layer.site.path}: mixes {method.label} expert tensors ({quantized[0].main.key}) with float ones "
            f"({dense[0].info.key}); a layer's experts must all be {method.label} or all be float"
        ]
    return []


def plan_experts(
    checkpoint: Checkpoint,
    sites: list[ExpertsSite],
    targets: dict[str, KeyTarget],
    quantized: dict[str, QuantizedWeight] | None = None,
    method: QuantMethod | None = None,
) -> ExpertPlan:
    """Split the checkpoint's keys into expert tensors per experts module and the rest.

    ``checkpoint`` shows quantized weights under their logical keys (``quant.logical_tensors``), which
    ``quantized`` maps to their stored tensors (read by ``method``); ``targets`` maps each key to its
    destination under transformers' rules for the model.
    Raises one ``LoadError`` listing every unexpected, duplicate, misshapen, non-float or missing tensor.
    """
    quantized = quantized or {}
    by_path = {s.path: s for s in sites}
    layers = {s.path: LayerPlan(s) for s in sites}
    seen: dict[tuple[str, str, int | None], str] = {}
    other: list[str] = []
    problems = _Problems()
    for key, info in checkpoint.tensors.items():
        site = _site_of(targets[key].target, by_path)
        weight = quantized.get(key)
        if site is not None and any(targets[key].target.startswith(f"{site.path}.{m}.") for m in site.kept):
            site = None  # a submodule the family keeps on the device (Muse Spark's post_expert_norm)
        if site is None:
            if weight is not None and method is not None and method.experts_only:
                problems.add(
                    f"{weight.main.file}: {weight.main.key} is {method.label} but not part of a routed-experts "
                    f"module; moetune (like transformers) reads {method.label} for routed experts only"
                )
            else:
                other.append(key)
            continue
        renamed = targets[key].renamed
        if targets[key].split:
            found = _split_site(targets[key], site, by_path)
            if isinstance(found, str):
                problems.add(f"{info.file}: unexpected expert tensor {key} for {site.path}: {found}")
                continue
            site, renamed = found
        parsed = _parse(info, renamed, site, targets[key])
        if parsed is None:  # read by nothing: neither an expert tensor nor one for transformers
            continue
        if isinstance(parsed, str):
            problems.add(f"{info.file}: unexpected expert tensor {key} for {site.path}: {parsed}")
            continue
        if weight is not None and method is not None:
            if not site.layout.gated:
                problems.add(
                    f"{weight.main.file}: {weight.main.key} is {method.label}; moetune reads the experts of "
                    f"non-gated families ({site.path}) from float checkpoints only"
                )
                continue
            if (why := method.expert_problem(weight, parsed.role, site)) is not None:
                problems.add(why)
                continue
            parsed = dataclasses.replace(parsed, quantized=weight)
        elif info.dtype not in FLOAT_DTYPES:
            problems.add(
                f"{info.file}: expert tensor {key} is {info.dtype}; moetune loads expert tensors in "
                f"{', '.join(FLOAT_DTYPES)}, or quantized by a quant_method it reads "
                f"({', '.join(QUANT_METHODS.names())}) that config.json's quantization_config declares"
            )
            continue
        slot = (site.path, parsed.role, parsed.expert)
        if slot in seen:
            problems.add(f"{info.file}: duplicate expert tensor {key} (the same weight as {seen[slot]})")
            continue
        seen[slot] = key
        layers[site.path].sources.append(parsed)
    for layer in layers.values():
        for message in _missing(layer) + _mixed(layer, method):
            problems.add(message)
        if any(s.quantized is not None for s in layer.sources):
            layer.method = method
    problems.raise_if_any(str(checkpoint.path))
    # Read shard by shard: a layer's place is its first shard's place in the checkpoint, then module order.
    rank = {name: i for i, name in enumerate(checkpoint.files)}
    ordered = sorted(layers.values(), key=lambda layer: min(rank[f] for f in layer.files))
    return ExpertPlan(ordered, other)
