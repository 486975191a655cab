"""LLaMA-Factory template names: the tokenizer's own chat template with the name's switches, the family check,
the built-in formats for checkpoints without a chat template, and every assistant turn trained on templates
that rewrite history (Qwen3's hybrid reasoning template)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from moetune.config import parse_config
from moetune.errors import ConfigError, DataError
from tests.unit.train.test_data import prepare, trained, word_tokenizer, write

# A hybrid reasoning template written for this test, behaving as Qwen3's does: earlier assistant turns lose
# their <think> block; the turns after the last user message show one (empty when there is no reasoning);
# the generation prompt with enable_thinking false holds an empty block.
HYBRID = (
    "{% set ns = namespace(last=0) %}{% for m in messages %}{% if m['role'] == 'user' %}"
    "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "{% set c = m['content'] %}{% set r = '' %}{% if '</think>' in c %}"
    "{% set r = c.split('</think>')[0].split('<think>')[-1].strip() %}{% set c = c.split('</think>')[-1].strip() %}"
    "{% endif %}{% if loop.index0 > ns.last %}"
    "<|im_start|>assistant\n<think>\n{{ r }}\n</think>\n\n{{ c }}<|im_end|>\n"
    "{% else %}<|im_start|>assistant\n{{ c }}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
CONVERSATION = [
    {"from": "human", "value": "hi"},
    {"from": "gpt", "value": "<think>a b</think>hello"},
    {"from": "human", "value": "how are you"},
    {"from": "gpt", "value": "fine thanks"},
    {"from": "human", "value": "bye"},
    {"from": "gpt", "value": "good bye"},
]


def hybrid_tokenizer() -> Any:
    tok = word_tokenizer(HYBRID)
    tok.add_special_tokens(
        {"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]}
    )
    return tok


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def as_messages(rows: list[dict[str, str]]) -> list[dict[str, str]]:
    roles = {"human": "user", "gpt": "assistant"}
    return [{"role": roles[m["from"]], "content": m["value"]} for m in rows]


@pytest.mark.parametrize(("template", "thinking"), [(None, None), ("qwen3", True), ("qwen3_nothink", False)])
def test_every_assistant_turn_of_a_history_rewriting_template_is_trained(
    workdir: Path, template: str | None, thinking: bool | None
) -> None:
    tok = hybrid_tokenizer()
    path = write(workdir / "chat.json", [{"conversations": CONVERSATION}])
    example = prepare(tok, path, **({"template": template} if template else {})).train[0]
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    reference = tok.apply_chat_template(as_messages(CONVERSATION), tokenize=False, **kwargs)
    assert example["input_ids"] == tok(reference, add_special_tokens=False)["input_ids"]  # token for token
    # history turns as the template shows them (reasoning dropped), the last with its empty reasoning block,
    # which with thinking off is part of the prompt the model is given
    last = "good bye <|im_end|>" if thinking is False else "<think> </think> good bye <|im_end|>"
    assert trained(tok, example) == f"hello <|im_end|> fine thanks <|im_end|> {last}"
    masked = prepare(tok, path, mask_history=True, **({"template": template} if template else {})).train[0]
    assert trained(tok, masked) == last


def test_a_name_from_another_family_is_an_error_naming_both(workdir: Path) -> None:
    path = write(workdir / "chat.json", [{"conversations": CONVERSATION}])
    with pytest.raises(
        DataError, match=r"'llama3' is the Llama 3 format.*'<\|start_header_id\|>'.*fit it: chatml"
    ):
        prepare(hybrid_tokenizer(), path, template="llama3")


def test_qwen_adds_its_default_system_and_the_config_wins(workdir: Path) -> None:
    tok = hybrid_tokenizer()
    path = write(workdir / "rows.json", [{"instruction": "hi", "output": "hello"}])
    for keys, system in (
        ({}, "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."),
        ({"default_system": "be brief"}, "be brief"),
    ):
        example = prepare(tok, path, template="qwen", **keys).train[0]
        messages = [
            {"role": "system", "content": system},
            *as_messages(CONVERSATION[:1]),
            {"role": "assistant", "content": "hello"},
        ]
        want = tok.apply_chat_template(messages, tokenize=False)
        assert example["input_ids"] == tok(want, add_special_tokens=False)["input_ids"]


def test_no_chat_template_renders_the_named_format(workdir: Path) -> None:
    """A checkpoint without a chat template: qwen3_nothink is LLaMA-Factory's ChatML, written out here."""
    tok = word_tokenizer(chat_template=None)
    rows = [{"instruction": "hi", "output": "hello", "history": [["how are you", "fine"]]}]
    example = prepare(tok, write(workdir / "rows.json", rows), template="qwen3_nothink").train[0]
    chatml = (
        "<|im_start|>user\nhow are you<|im_end|>\n<|im_start|>assistant\nfine<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"
    )
    assert example["input_ids"] == tok(chatml, add_special_tokens=False)["input_ids"]
    assert trained(tok, example) == "fine <|im_end|> hello <|im_end|>"
    with pytest.raises(DataError, match=r"vocabulary has no '<\|start_header_id\|>'"):
        prepare(tok, write(workdir / "rows.json", rows), template="llama3")
    tok.add_special_tokens({"additional_special_tokens": ["<|start|>", "<|message|>", "<|channel|>"]})
    with pytest.raises(DataError, match="no built-in one for 'gpt_oss'"):
        prepare(tok, write(workdir / "rows.json", rows), template="gpt_oss")


def test_template_names_in_the_config(workdir: Path) -> None:
    base = {"model_name_or_path": "m", "dataset": "d.json", "output_dir": "out"}
    (workdir / "d.json").write_text("[]")
    data = parse_config({**base, "template": "qwen3_nothink"}, check_model_path=False).data
    assert (data.template_name, data.template_file) == ("qwen3_nothink", None)
    (workdir / "t.jinja").write_text("{{ messages }}")
    data = parse_config({**base, "template": "t.jinja"}, check_model_path=False).data
    assert (data.template_name, data.template_file) == (None, Path("t.jinja"))
    with pytest.raises(
        ConfigError, match=r"template: 'vicuna_x' is not a LLaMA-Factory template name.*qwen3"
    ):
        parse_config({**base, "template": "vicuna_x"}, check_model_path=False)
    with pytest.raises(ConfigError, match="enable_thinking: is True but template 'qwen3_nothink' means"):
        parse_config({**base, "template": "qwen3_nothink", "enable_thinking": True}, check_model_path=False)


@pytest.mark.parametrize(
    ("name", "want"),
    [
        (
            "llama3",
            "<s><|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|><|start_header_id|>user<|end_header_id|>"
            "\n\nQ1<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nA1<|eot_id|><|start_header_id|>user"
            "<|end_header_id|>\n\nQ2<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nA2<|eot_id|>",
        ),
        ("deepseek3", "<s>S<｜User｜>Q1<｜Assistant｜>A1</s><｜User｜>Q2<｜Assistant｜>A2</s>"),
        ("deepseek", "<s>S\n\nUser: Q1\n\nAssistant:A1</s>User: Q2\n\nAssistant:A2</s>"),
        ("mistral", "<s>[INST] S\n\nQ1[/INST] A1</s>[INST] Q2[/INST] A2</s>"),
        (
            "qwen3",
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\n"
            "<think>\n\n</think>\n\nA1<|im_end|>\n<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n"
            "<think>\n\n</think>\n\nA2<|im_end|>\n",
        ),
    ],
)
def test_builtin_formats_write_llamafactorys_text(name: str, want: str) -> None:
    """The fallbacks against LLaMA-Factory's formats, written out (bos <s>, eos </s>)."""
    from moetune.config.chat_templates import NAMED_TEMPLATES

    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "A2"},
    ]
    tok = word_tokenizer(chat_template=None)
    assert (
        tok.apply_chat_template(messages, chat_template=NAMED_TEMPLATES[name].fallback, tokenize=False)
        == want
    )


# each family moetune trains (moetune.testing.tiny's builders, the README's model table) -> LLaMA-Factory's names
FAMILY_NAMES = {
    "qwen3_moe": ("qwen3", "qwen3_nothink"),
    "qwen2_moe": ("qwen",),
    "qwen3_vl_moe": ("qwen3_vl", "qwen3_vl_nothink"),
    "qwen3_5_moe": ("qwen3_5", "qwen3_5_nothink"),
    "mixtral": ("mistral",),
    "olmoe": ("olmo",),
    "deepseek_v2": ("deepseek",),
    "deepseek_v3": ("deepseek3", "deepseekr1", "moonlight"),  # Kimi-K2 loads as DeepSeek-V3
    "glm4_moe": ("glm4_moe", "glm4_7"),
    "gpt_oss": ("gpt_oss",),
    "ernie4_5_moe": ("ernie", "ernie_nothink"),
    "minimax": ("minimax1",),
}


def test_every_trained_family_has_its_llamafactory_names() -> None:
    from moetune.config.chat_templates import NAMED_TEMPLATES
    from moetune.testing.tiny import TINY_FAMILIES

    assert set(FAMILY_NAMES) == set(TINY_FAMILIES.names())
    for family, names in FAMILY_NAMES.items():
        assert set(names) <= set(NAMED_TEMPLATES), family


@pytest.mark.parametrize(
    "name", ["ernie", "ernie_nothink", "minimax1", "olmo", "moonlight", "glm4_7", "glm4_moe"]
)
def test_a_name_fits_its_own_family_and_not_another(name: str) -> None:
    """A chat template holding the name's markers fits it; one of another family (Llama 3's) is refused, naming
    the marker that is missing."""
    from moetune.config.chat_templates import NAMED_TEMPLATES, family_problem

    own = "{{ bos_token }}" + "{{ m }}".join(NAMED_TEMPLATES[name].markers)
    assert family_problem(name, own, set()) is None
    llama3 = "<|start_header_id|>{{ m['role'] }}<|end_header_id|>{{ m['content'] }}<|eot_id|>"
    problem = family_problem(name, llama3, set())
    assert problem is not None and repr(NAMED_TEMPLATES[name].markers[0]) in problem


@pytest.mark.parametrize(
    ("name", "system"),
    [
        ("ernie", "<global_setting>\nthink_mode=True\n</global_setting>"),
        ("minimax1", "You are a helpful assistant."),
        ("moonlight", "You are a helpful assistant provided by Moonshot-AI."),
    ],
)
def test_names_with_a_default_system_add_it(workdir: Path, name: str, system: str) -> None:
    """LLaMA-Factory's default system message for the name, when a conversation has none, rendered by the
    tokenizer's own chat template."""
    from moetune.config.chat_templates import NAMED_TEMPLATES

    markers = " ".join(NAMED_TEMPLATES[name].markers)
    tok = word_tokenizer(
        "{% for m in messages %}" + markers + " {{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
    )
    path = write(workdir / "rows.json", [{"instruction": "hi", "output": "hello"}])
    example = prepare(tok, path, template=name).train[0]
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]
    want = tok.apply_chat_template([*messages, {"role": "assistant", "content": "hello"}], tokenize=False)
    assert example["input_ids"] == tok(want, add_special_tokens=False)["input_ids"]


def test_the_saved_tokenizer_renders_prompts_as_training_did(workdir: Path) -> None:
    """``saved_chat_template``: what recipe.save writes into the output's tokenizer, so that generate, chat and
    serving give the trained model the prompts it was trained on (the tokenizer's own template lacked the run's
    template, enable_thinking and default_system)."""
    from moetune.train.templates import ExampleEncoder, saved_chat_template

    tok = hybrid_tokenizer()
    (workdir / "t.jinja").write_text(HYBRID.replace("<|im_start|>", "<|im_start|> "))
    user = [{"role": "user", "content": "hi"}]
    data = write(workdir / "rows.json", [{"instruction": "hi", "output": "hello"}])

    def config(**keys: Any) -> Any:
        return parse_config(
            {"model_name_or_path": "m", "dataset": data, "output_dir": "o", **keys}, check_model_path=False
        ).data

    def prompt(template: str | None, messages: list, **kwargs: Any) -> str:
        return tok.apply_chat_template(
            messages, chat_template=template, tokenize=False, add_generation_prompt=True, **kwargs
        )

    assert saved_chat_template(tok, config()) is None  # the tokenizer's own, unchanged: nothing to write
    cfg = config(template="t.jinja", default_system="be brief", enable_thinking=False)
    saved = saved_chat_template(tok, cfg)
    encoder = ExampleEncoder(tok, cfg)
    trained = encoder.renderer.render(
        [{"role": "system", "content": "be brief"}, *user], add_generation_prompt=True
    )
    assert prompt(saved, user) == trained
    assert trained.startswith("<|im_start|> system\nbe brief") and trained.endswith("<think>\n\n</think>\n\n")
    own_system = [{"role": "system", "content": "mine"}, *user]  # a conversation's own system message wins
    assert prompt(saved, own_system) == encoder.renderer.render(own_system, add_generation_prompt=True)
    assert not prompt(saved, user, enable_thinking=True).endswith("</think>\n\n")  # and a caller's switch
    # a LLaMA-Factory name on the tokenizer's own template: its switch written in
    nothink = saved_chat_template(tok, config(template="qwen3_nothink"))
    assert nothink is not None and prompt(nothink, user) == prompt(None, user, enable_thinking=False)
    quotes = saved_chat_template(tok, config(default_system='say "hi"\n{{ x }}'))  # a literal, not Jinja
    assert quotes is not None and 'say "hi"\n{{ x }}' in prompt(quotes, user)
