"""``moetune chat --adapter DIR`` on the demo model with piped stdin: continuation lines, conversation history
through the chat template, /reset and /exit; every answer against stock transformers + PEFT generating
greedily from the conversation it should have seen."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from moetune.cli.main import main
from moetune.train.demo import make_demo_model

ROOT = Path(__file__).resolve().parents[2]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> tuple[Path, Path]:
    """The demo model and an adapter with random LoRA everywhere (saved without a tokenizer)."""
    from moetune.adapters import attach_lora, save_adapter
    from moetune.loading import load_model

    tmp = tmp_path_factory.mktemp("chat")
    model_dir = make_demo_model(tmp / "tiny", ROOT / "examples/data/demo_tokenizer")
    peft = attach_lora(load_model(model_dir, device="cpu", dtype="float32", progress=False), rank=4, alpha=8)
    gen = torch.Generator().manual_seed(0)  # a seed whose three replies below are non-empty and differ
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model_dir, save_adapter(peft, tmp / "adapter")


def reference_reply(model_dir: Path, adapter: Path, messages: list[dict[str, str]]) -> str:
    """Stock transformers + PEFT, the conversation rendered by the tokenizer's own chat template, greedy."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), adapter).eval()
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True).strip()


def test_chat_continuation_history_reset_exit(demo, monkeypatch, capsys) -> None:
    model_dir, adapter = demo
    script = "encode\\\nb c f b\n\nencode d e\n/reset\nencode d e\n/exit\nencode never answered\n"
    monkeypatch.setattr("sys.stdin", io.StringIO(script))
    argv = ["chat", "--model", str(model_dir), "--adapter", str(adapter), "--max-new-tokens", str(NEW_TOKENS)]
    assert main(argv) == 0
    out = capsys.readouterr()
    assert "(conversation reset)" in out.err

    first = {"role": "user", "content": "encode\nb c f b"}  # the backslash joined two lines into one message
    r1 = reference_reply(model_dir, adapter, [first])
    second = {"role": "user", "content": "encode d e"}
    r2 = reference_reply(model_dir, adapter, [first, {"role": "assistant", "content": r1}, second])
    r3 = reference_reply(model_dir, adapter, [second])  # after /reset: no history
    assert all((r1, r2, r3)) and r2 != r3  # the history changes the answer: the check below tells them apart
    assert out.out.splitlines() == [r1, r2, r3]  # nothing after /exit is answered
