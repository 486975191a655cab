"""Does a transformers MoE family load exactly in moetune? One tiny random checkpoint, two models, compared.

``survey_family(model_type, workdir)`` saves a random model of ``families.survey_config(model_type)`` with
``save_pretrained`` (safetensors, the family's own on-disk layout), loads it with ``moetune.load_model`` in
float64 on the CPU, loads the same folder with transformers (the class moetune built, ``from_pretrained``) in
float64 too, and compares:

    every engine's expert weights with the transformers    equal (all experts, also those a text batch never
    module it replaced, in the engine's layout              reaches, such as ERNIE-4.5-VL's vision experts)
    logits on one batch of token ids (no grad)             max |diff| <= tol * max(1, max |logits|)
    loss.backward(): the gradient of every parameter       max |diff| <= tol * max(1, max |grad|)
    outside the routed experts (routers, attention, shared experts, embeddings, and a norm the experts module
    applies to each expert's output, which moetune keeps as a torch module)

with tol = ``TOL``. The arithmetic is float64 so that the two sides' summation orders do not decide the outcome:
in float32 (as the survey ran before) they alone reached 1-2.4x the tolerance on Gemma 4 on an AMD Zen 4, so a
pass or fail said as much about the CPU as about the code. Many families' modeling code still rounds to float32
at a few points even in a float64 model (RMSNorm's ``.to(torch.float32)``, float32 router logits and softmax):
where the engine's last-bit difference falls across such a rounding, one float32 ulp (6e-8 relative) appears and
propagates. Measured in float64: 1e-17 to 5e-15 where no rounding flips (Qwen3-MoE, DeepSeek-V3, Gemma 4), up
to 6e-7 where one does (Nemotron-H, Nemotron-H Omni, LongCat-Flash, Beam, Inkling 2), against ``TOL`` = 1e-5; a real
difference in the computation (an activation, a scale, an expert or a row left out) is orders of magnitude larger.

An omni model moetune loads a part of (Qwen3-Omni: its thinker) is saved whole, as released.

It returns ``"exact"``, ``"refused: <ArchError text>"`` (moetune declined the family: the test checks the
text names it), or ``"mismatch: <what differs>"``. Anything else moetune raises propagates: a crash is a bug.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

DTYPE = torch.float64  # the survey's load dtype (module docstring)
TOL = 1e-5  # relative: summation order, and float32 rounding points inside some families (module docstring)

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


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """max |a - b| and the tolerance for it (relative to ``a`` where ``a`` exceeds 1)."""
    return (a - b).abs().max().item(), TOL * max(1.0, a.abs().max().item())


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
        theirs = ref.get_submodule(path)
        gate_up, down = engine.weights.dequantize(next(theirs.parameters()).dtype)
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
        if not (torch.equal(gate_up, want_gu[: len(gate_up)]) and torch.equal(down, want_down)):
            problems.append(f"{path}: expert weights differ from transformers' module")
    return problems


def compare(ref: Any, model: Any, seed: int = 0) -> list[str]:
    """What differs between transformers' ``ref`` and moetune's ``model`` (empty: nothing)."""
    batch = _inputs(seed, int(ref.config.get_text_config().vocab_size))
    problems = [] if _expert_paths(model) else ["no experts module runs in the engine"]
    problems += _weight_problems(ref, model)
    with torch.no_grad():
        diff, tol = _max_diff(ref(**batch).logits, model(**batch).logits)
    if not diff <= tol:
        problems.append(f"logits differ by {diff:.3g} (tolerance {tol:.3g})")
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
            diff, tol = _max_diff(want, have)
            if not diff <= tol:
                problems.append(f"{name}: gradient differs by {diff:.3g} (tolerance {tol:.3g})")
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
        loaded = moetune.load_model(path, dtype=DTYPE, device="cpu", progress=False, num_threads=1)
    except ArchError as e:
        return f"refused: {e}"
    # transformers' eager experts: its default grouped_mm takes no float64
    ref = type(loaded).from_pretrained(path, dtype=DTYPE, experts_implementation="eager").eval()
    run_on = RUN_ON.get(model_type)
    if run_on is not None:
        ref, loaded = ref.get_submodule(run_on), loaded.get_submodule(run_on)
    problems = compare(ref, loaded, seed)
    return "exact" if not problems else "mismatch: " + "; ".join(problems[:6])
