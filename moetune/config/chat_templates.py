"""LLaMA-Factory's ``template`` names, mapped onto the checkpoint's own chat template.

LLaMA-Factory renders conversations with its own per-family formats, chosen by ``template: NAME``. moetune
renders with the tokenizer's Jinja chat template (the format the model was trained with and is served with),
so a name here selects:

- the **family check**: a tokenizer whose chat template (or, without one, whose vocabulary) lacks the family's
  marker tokens is an error naming both (``llama3`` on a Qwen tokenizer);
- the **switches** LLaMA-Factory's template implies: ``enable_thinking`` (``qwen3`` on, ``qwen3_nothink``
  off) and a ``default_system`` message for conversations without one (``qwen``, ``ernie``, ``minimax1``,
  ``moonlight``);
- a **fallback** Jinja template, written here, for checkpoints that ship no chat template (ChatML for the
  Qwen names, llama3, llama4, deepseek, deepseek3 and mistral). The other names (``gpt_oss``, ``glm4_moe``,
  ``glm4_7``, ``deepseekr1``, ``ernie``, ``ernie_nothink``, ``minimax1``, ``olmo``, ``moonlight``) have none: their
  formats (channels, reasoning blocks, special openers) need the checkpoint's own template.

There is a name for every family moetune trains (README, "Models: what is tested"): Qwen2/3-MoE, Qwen3-VL-MoE and
Qwen3.5-MoE (the Qwen/ChatML names), Mixtral (``mistral``), OLMoE (``olmo``), DeepSeek-V2 (``deepseek``),
DeepSeek-V3/R1 (``deepseek3``, ``deepseekr1``), Kimi-K2 (``moonlight``), GLM-4.5 (``glm4_moe``, ``glm4_7``),
gpt-oss (``gpt_oss``), ERNIE-4.5-MoE (``ernie``, ``ernie_nothink``) and MiniMax (``minimax1``).

The user's own ``enable_thinking`` / ``default_system`` keys win over a name's defaults; a contradiction
(``qwen3_nothink`` with ``enable_thinking: true``) is reported.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NamedTemplate:
    """What a LLaMA-Factory template name means to moetune."""

    family: str  # words for messages
    markers: tuple[str, ...]  # tokens every template of the family writes
    enable_thinking: bool | None = None  # passed to the chat template; None: the template's own default
    default_system: str | None = None  # system message for conversations without one
    fallback: str | None = None  # Jinja used when the tokenizer has no chat template
    plain_text: bool = False  # the markers are plain words, not tokens: a vocabulary cannot be checked


# ChatML: <|im_start|>role\ncontent<|im_end|>\n, as LLaMA-Factory's chatml/qwen formats write it
_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# LLaMA-Factory's qwen3 (thinking on) trains an empty reasoning block before each answer that has none
_CHATML_THINKING = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and '<think>' not in m['content'] %}<think>\n\n</think>\n\n{% endif %}"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
_LLAMA4 = (
    "{{ bos_token }}{% for m in messages %}<|header_start|>{{ m['role'] }}<|header_end|>\n\n"
    "{{ m['content'] }}<|eot|>{% endfor %}"
    "{% if add_generation_prompt %}<|header_start|>assistant<|header_end|>\n\n{% endif %}"
)
# system text first, then <｜User｜>q<｜Assistant｜>a<eos> per turn
_DEEPSEEK3 = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}<｜User｜>{{ m['content'] }}<｜Assistant｜>"
    "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)
# [INST] q[/INST] a</s>; the system text opens the first user message
_MISTRAL = (
    "{{ bos_token }}{% set ns = namespace(system='') %}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% set ns.system = m['content'] + '\n\n' %}"
    "{% elif m['role'] == 'user' %}[INST] {{ ns.system }}{{ m['content'] }}[/INST]{% set ns.system = '' %}"
    "{% else %} {{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)

# DeepSeek-V2: system text, then "User: q\n\nAssistant: a<eos>" per turn
_DEEPSEEK = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}\n\n"
    "{% elif m['role'] == 'user' %}User: {{ m['content'] }}\n\nAssistant:"
    "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)

_QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
_ERNIE_SYSTEM = "<global_setting>\nthink_mode=True\n</global_setting>"
_MOONSHOT_SYSTEM = "You are a helpful assistant provided by Moonshot-AI."
_CHATML_MARKERS = ("<|im_start|>", "<|im_end|>")
_GLM_MARKERS = ("[gMASK]", "<|user|>", "<|assistant|>")  # GLM's templates open with [gMASK]<sop>

NAMED_TEMPLATES: dict[str, NamedTemplate] = {
    "chatml": NamedTemplate("ChatML", _CHATML_MARKERS, fallback=_CHATML),
    "qwen": NamedTemplate("ChatML (Qwen)", _CHATML_MARKERS, default_system=_QWEN_SYSTEM, fallback=_CHATML),
    "qwen3": NamedTemplate(
        "ChatML (Qwen3)", _CHATML_MARKERS, enable_thinking=True, fallback=_CHATML_THINKING
    ),
    "qwen3_nothink": NamedTemplate(
        "ChatML (Qwen3)", _CHATML_MARKERS, enable_thinking=False, fallback=_CHATML
    ),
    "qwen3_5": NamedTemplate(
        "ChatML (Qwen3.5)", _CHATML_MARKERS, enable_thinking=True, fallback=_CHATML_THINKING
    ),
    "qwen3_5_nothink": NamedTemplate(
        "ChatML (Qwen3.5)", _CHATML_MARKERS, enable_thinking=False, fallback=_CHATML
    ),
    "qwen3_6": NamedTemplate(
        "ChatML (Qwen3.6)", _CHATML_MARKERS, enable_thinking=True, fallback=_CHATML_THINKING
    ),
    # the Qwen3-VL names on Qwen3-VL-MoE checkpoints, text only
    "qwen3_vl": NamedTemplate(
        "ChatML (Qwen3-VL)", _CHATML_MARKERS, enable_thinking=True, fallback=_CHATML_THINKING
    ),
    "qwen3_vl_nothink": NamedTemplate(
        "ChatML (Qwen3-VL)", _CHATML_MARKERS, enable_thinking=False, fallback=_CHATML
    ),
    "llama3": NamedTemplate("Llama 3", ("<|start_header_id|>", "<|eot_id|>"), fallback=_LLAMA3),
    "llama4": NamedTemplate("Llama 4", ("<|header_start|>", "<|eot|>"), fallback=_LLAMA4),
    "deepseek": NamedTemplate(
        "DeepSeek-V2 (User:/Assistant:)", ("User: ", "Assistant:"), fallback=_DEEPSEEK, plain_text=True
    ),
    "deepseek3": NamedTemplate("DeepSeek-V3", ("<｜User｜>", "<｜Assistant｜>"), fallback=_DEEPSEEK3),
    "deepseekr1": NamedTemplate("DeepSeek-R1", ("<｜User｜>", "<｜Assistant｜>")),
    "mistral": NamedTemplate("Mistral/Mixtral", ("[INST]", "[/INST]"), fallback=_MISTRAL),
    "gpt_oss": NamedTemplate("gpt-oss (harmony)", ("<|start|>", "<|message|>", "<|channel|>")),
    "glm4_moe": NamedTemplate("GLM-4-MoE", _GLM_MARKERS),
    "glm4_7": NamedTemplate("GLM-4.7 (GLM-4-MoE)", _GLM_MARKERS),
    # ERNIE-4.5-MoE: the base/instruct format (plain "User: " / "Assistant: " turns) and the thinking models'
    # ChatML-like one, whose reasoning switch LLaMA-Factory writes as a default system message
    "ernie_nothink": NamedTemplate("ERNIE-4.5", ("User: ", "Assistant: "), plain_text=True),
    "ernie": NamedTemplate("ERNIE-4.5 thinking (ChatML)", _CHATML_MARKERS, default_system=_ERNIE_SYSTEM),
    "minimax1": NamedTemplate(
        "MiniMax-Text-01",
        ("<beginning_of_sentence>", "<end_of_sentence>"),
        default_system="You are a helpful assistant.",
    ),
    # OLMoE-Instruct (Tulu format); its role markers are plain text in OLMo's vocabulary
    "olmo": NamedTemplate("OLMo/OLMoE (Tulu)", ("<|user|>", "<|assistant|>"), plain_text=True),
    # Kimi-K2's format, which LLaMA-Factory names after Moonlight
    "moonlight": NamedTemplate(
        "Kimi/Moonlight",
        ("<|im_user|>", "<|im_assistant|>", "<|im_middle|>"),
        default_system=_MOONSHOT_SYSTEM,
    ),
}

# file suffixes read as a Jinja template file rather than a name
TEMPLATE_SUFFIXES = (".jinja", ".j2", ".jinja2", ".txt")


def family_problem(name: str, chat_template: str | None, vocab: set[str]) -> str | None:
    """Why template ``name`` does not fit a tokenizer with ``chat_template`` (None: it has none) and ``vocab``
    (its token strings), or None when it fits."""
    spec = NAMED_TEMPLATES[name]
    where = "chat template" if chat_template else "vocabulary"

    def fits(s: NamedTemplate) -> bool:
        if chat_template:
            return all(m in chat_template for m in s.markers)
        return s.plain_text or all(m in vocab for m in s.markers)

    if fits(spec):
        return None
    missing = [m for m in spec.markers if m not in (chat_template or vocab)]
    fitting = [n for n, s in NAMED_TEMPLATES.items() if fits(s) and not s.plain_text]
    hint = (
        f"names that fit it: {', '.join(fitting)}"
        if fitting
        else "remove `template` to use the tokenizer's own"
    )
    return (
        f"template {name!r} is the {spec.family} format, but the tokenizer's {where} has no {missing[0]!r}: it "
        f"is another family's tokenizer; set `template` to the model's own family ({hint})"
    )
