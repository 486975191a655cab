"""Does a transformers MoE family load exactly in moetune? One tiny random checkpoint, two models, compared.

``survey_family(model_type, workdir)`` saves a random model of ``families.survey_config(model_type)`` with
``save_pretrained`` (safetensors, the family's own on-disk layout), loads it with ``moetune.load_model`` in
float64 on the CPU, loads the same folder with transformers in float64 (the class moetune built,
``from_pretrained``, with transformers' eager experts: its grouped-GEMM path takes no float64) and compares:

    every engine's expert weights with the transformers    equal (all experts, also those a text batch never
    module it replaced, in the engine's layout              reaches, such as ERNIE-4.5-VL's vision experts)
    logits on one batch of token ids (no grad)             max |diff| <= tol * max(1, max |logits|)
    loss.backward(): the gradient of every parameter       max |diff| <= tol * max(1, max |grad|)
    outside the routed experts (routers, attention, shared experts, embeddings, and a norm the experts module
    applies to each expert's output, which moetune keeps as a torch module)

with ``tol = TOL`` (1e-10), or ``TOL_FLOAT32_INSIDE`` (1e-5) for the families whose transformers experts round to
float32 inside a float64 model (``FLOAT32_INSIDE``, each with where).

An omni model moetune loads a part of (Qwen3-Omni: its thinker) is saved whole, as released.

It returns ``"exact"``, ``"refused: <ArchError text>"`` (moetune declined the family: the test checks the
text names it), or ``"mismatch: <what differs>"``. Anything else moetune raises propagates: a crash is a bug.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

DTYPE = torch.float64
TOL = 1e-10
"""Both models in float64, so that the tolerance measures the code and not float32 rounding. The engine and
transformers differ in summation order, and a family's gradients amplify that rounding by their conditioning:
Gemma 4 (sandwich and q/k/v norms, per-layer inputs) ~100x more than the others. In float32 transformers' own
Gemma 4 gradient is 2.8e-5 (relative) off its float64 gradient, over the 1e-5 float32 tolerance this survey had
(the engine's differed by 1-2.4x 1e-5, depending on the CPU), against 2-4e-7 for Qwen3-MoE, DeepSeek-V3, Mixtral,
OLMoE. In float64 the worst difference over every family is 1.5e-15 (Gemma 4; most are below 1e-16): 1e-10 leaves
a wide margin and stays far below float32 rounding (6e-8), so an engine computing anything in float32 fails."""

FLOAT32_INSIDE = {
    "beam": "its experts compute the activation in float32 (act_fn(gate.float()) * up.float())",
    "inkling2": "its experts sum the weighted outputs in a float32 buffer",
    "inkling2_loop": "its experts sum the weighted outputs in a float32 buffer",
    "nemotron_h": "its experts sum the weighted outputs in the routing weights' dtype (float32)",
    "nemotron_h_omni": "its language model's experts sum in the routing weights' dtype (float32), as nemotron_h",
    "muse_spark": "its post_expert_norm (kept by moetune, run on the engine's output) computes in float32",
}
"""Families whose transformers experts round to float32 inside a float64 model, with where: compared with
``TOL_FLOAT32_INSIDE``. Their worst float64 difference is 3.1e-7 (inkling2's logits, relative), float32
rounding carried through the model, where the others stay below 1.5e-15."""
TOL_FLOAT32_INSIDE = 1e-5  # the float32 tolerance: 30x over the worst of these families in float64

RUN_ON = {"llama4": "language_model"}
"""Families whose whole model's forward fails in transformers 5.24 itself, compared on a submodule instead:
``Llama4ForConditionalGeneration.forward`` reads ``image_outputs`` off its language model's output, which has
none, on every input."""
BATCH, SEQ = 2, 12


def _random_model(config: Any, seed: int) -> Any:
    """The model a release of ``config`` is saved from, with random weights (``tiny.randomize_``): the class
    ``load_model`` builds, or for an omni model that it loads a part of (Qwen3-Omni's thinker), the whole."""
    from transformers import MODEL_FOR_MULTIMODAL_LM_MAPPING

    from moetune.loading.hf import model_class
    from moetune.testing.tiny import randomize_

    loaded, part = model_class(config)
    whole = part is not config and type(config) in MODEL_FOR_MULTIMODAL_LM_MAPPING
    cls: Any = MODEL_FOR_MULTIMODAL_LM_MAPPING[type(config)] if whole else loaded
    config = config if whole else part
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
    randomize_(model, seed)
    _randomize_lookup_tables(model, seed)
    return model.eval()


@torch.no_grad()
def _randomize_lookup_tables(model: Any, seed: int) -> None:
    """Integer routing tables (DeepSeek-V4's hash router ``tid2eid [V, k]``) get distinct random experts per row:
    all-zero tables would send every token to expert 0 k times."""
    gen = torch.Generator().manual_seed(seed)
    for name, buf in model.named_buffers():
        if name.endswith("tid2eid"):
            experts = int(model.config.get_text_config().num_local_experts)
            rows = [torch.randperm(experts, generator=gen)[: buf.shape[1]] for _ in range(buf.shape[0])]
            buf.copy_(torch.stack(rows))


def _inputs(seed: int, vocab: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, min(vocab, 96), (BATCH, SEQ), generator=gen)
    return {"input_ids": ids, "labels": ids}


def _max_diff(a: torch.Tensor, b: torch.Tensor, tol: float) -> tuple[float, float]:
    """max |a - b| and the tolerance for it: ``tol`` relative to ``a`` where ``a`` exceeds 1."""
    return (a - b).abs().max().item(), tol * max(1.0, a.abs().max().item())


def _expert_paths(model: Any) -> list[str]:
    from moetune.layer import CpuExperts

    return [n for n, m in model.named_modules() if isinstance(m, CpuExperts)]


def _engine_layout(t: torch.Tensor, transposed: bool, interleaved: bool) -> torch.Tensor:
    """A transformers experts tensor ``[E, a, b]`` in the engine's layout (``[E, out, in]``, gate rows first)."""
    t = t.transpose(1, 2) if transposed else t
    return torch.cat((t[:, 0::2], t[:, 1::2]), dim=1) if interleaved else t


def _weight_problems(ref: Any, model: Any) -> list[str]:
    """Each engine's expert weights against the transformers module they replaced: every expert, including
    those a text batch never reaches (ERNIE-4.5-VL's vision experts)."""
    from moetune.arch.detect import DOWN, GATE_UP, UP

    problems = []
    for path in _expert_paths(model):
        engine, lay = model.get_submodule(path).engine, model.get_submodule(path).layout
        gate_up, down = engine.weights.dequantize(DTYPE)
        theirs = ref.get_submodule(path)
        if lay.flat is not None:  # flat [E*I, H] matrices (DBRX): gate, up, and down transposed
            gate, up, flat_down = (
                theirs.get_parameter(n).detach().view(lay.num_experts, lay.intermediate_size, -1)
                for n in lay.flat.names
            )
            want_gu, want_down = torch.cat((gate, up), dim=1), flat_down.transpose(1, 2)
        elif lay.gated:
            want_gu = _engine_layout(getattr(theirs, GATE_UP).detach(), lay.transposed, lay.interleaved)
        else:  # non-gated experts run as gated ones whose gate rows are their up rows
            up = _engine_layout(getattr(theirs, UP).detach(), lay.transposed, False)
            want_gu = torch.cat((up, up), dim=1)
        if lay.flat is None:
            want_down = _engine_layout(getattr(theirs, DOWN).detach(), lay.transposed, False)
        want_gu, want_down = want_gu.to(DTYPE), want_down.to(DTYPE)  # exact: a float32 reference widens
        if not (torch.equal(gate_up, want_gu[: len(gate_up)]) and torch.equal(down, want_down)):
            problems.append(f"{path}: expert weights differ from transformers' module")
    return problems


def compare(ref: Any, model: Any, seed: int = 0, tol: float = TOL) -> list[str]:
    """What differs between transformers' ``ref`` and moetune's ``model`` (empty: nothing); ``tol`` relative."""
    batch = _inputs(seed, int(ref.config.get_text_config().vocab_size))
    problems = [] if _expert_paths(model) else ["no experts module runs in the engine"]
    problems += _weight_problems(ref, model)
    with torch.no_grad():
        diff, bound = _max_diff(ref(**batch).logits, model(**batch).logits, tol)
    if not diff <= bound:
        problems.append(f"logits differ by {diff:.3g} (tolerance {bound:.3g})")
    for m in (ref, model):
        m.train()
        m.zero_grad()
        torch.manual_seed(seed)  # routers with jitter noise in training draw the same noise
        m(**batch).loss.backward()
        m.eval()
    experts = [p + "." for p in _expert_paths(model)]
    got = dict(model.named_parameters())
    # inside an experts module only what moetune keeps as a torch module (Muse Spark's post_expert_norm)
    ref_params = {n: p for n, p in ref.named_parameters() if not n.startswith(tuple(experts)) or n in got}
    if set(got) != set(ref_params):
        problems.append(f"parameters differ: {sorted(set(got) ^ set(ref_params))[:8]}")
    for name in sorted(set(got) & set(ref_params)):
        want, have = ref_params[name].grad, got[name].grad
        if (want is None) != (have is None):
            problems.append(f"{name}: gradient {'missing' if have is None else 'unexpected'}")
        elif want is not None and have is not None:
            diff, bound = _max_diff(want, have, tol)
            if not diff <= bound:
                problems.append(f"{name}: gradient differs by {diff:.3g} (tolerance {bound:.3g})")
    return problems


def survey_family(model_type: str, workdir: str | Path, seed: int = 0) -> str:
    """``"exact"``, ``"refused: <ArchError text>"`` or ``"mismatch: ..."`` for ``model_type`` (see the module)."""
    import moetune
    from moetune.errors import ArchError
    from moetune.testing.families import survey_config

    path = Path(workdir)
    config = survey_config(model_type)
    try:
        model = _random_model(config, seed)
    except ArchError as e:  # transformers has no causal-LM / image-text-to-text class for it
        return f"refused: {e}"
    model.save_pretrained(path)
    try:
        loaded = moetune.load_model(path, dtype="float64", device="cpu", progress=False, num_threads=1)
    except ArchError as e:
        return f"refused: {e}"
    ref = type(loaded).from_pretrained(path, dtype=DTYPE, experts_implementation="eager").eval()
    run_on = RUN_ON.get(model_type)
    if run_on is not None:
        ref, loaded = ref.get_submodule(run_on), loaded.get_submodule(run_on)
    problems = compare(ref, loaded, seed, TOL_FLOAT32_INSIDE if model_type in FLOAT32_INSIDE else TOL)
    return "exact" if not problems else "mismatch: " + "; ".join(problems[:6])
