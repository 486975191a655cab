"""``check_output_dir`` probes the folder ``moetune train`` will write, leaving nothing behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from moetune.errors import OutputDirError
from moetune.train.preflight import check_output_dir


@pytest.mark.parametrize("out", ["existing", "new/nested/run"])
def test_a_writable_output_dir_passes_and_nothing_is_left(tmp_path, out) -> None:
    (tmp_path / "existing").mkdir()
    before = sorted(tmp_path.rglob("*"))
    check_output_dir(tmp_path / out)
    assert sorted(tmp_path.rglob("*")) == before  # no probe file, no folder created


def test_a_file_in_the_path(tmp_path) -> None:
    (tmp_path / "f").write_text("")
    with pytest.raises(OutputDirError, match=r"f is a file, not a folder, so .*f/a/b cannot be created"):
        check_output_dir(tmp_path / "f" / "a" / "b")


def test_a_folder_that_refuses_new_files() -> None:
    """/sys refuses new files even to root (a chmod would not stop root, who runs the CI)."""
    with pytest.raises(OutputDirError, match=r"cannot write in /sys \(Permission denied\)"):
        check_output_dir(Path("/sys/moetune/run"))


def test_resume_notes_say_what_a_checkpoint_restores_or_restarts(tmp_path) -> None:
    """A checkpoint without optimizer or scheduler state resumed silently with both restarted, and a changed
    learning_rate was silently replaced by the scheduler's saved one: both are now said (transformers resumes
    so; not refused)."""
    import torch

    from moetune.config import parse_config
    from moetune.train.preflight import resume_notes

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "d.json").write_text('[{"instruction": "a", "output": "b"}]')
    cfg = parse_config(
        {
            "model_name_or_path": str(tmp_path / "m"),
            "dataset": str(tmp_path / "d.json"),
            "output_dir": str(tmp_path / "o"),
            "learning_rate": 1e-3,
        }
    )
    ckpt = tmp_path / "checkpoint-4"
    ckpt.mkdir()
    (only_model,) = resume_notes(ckpt, cfg)
    assert "holds no optimizer or scheduler state" in only_model and "not an exact resume" in only_model
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-2)
    torch.save(
        torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0).state_dict(), ckpt / "scheduler.pt"
    )
    (ckpt / "optimizer.index.json").write_text("{}")  # moetune's own, under full / freeze
    (lr,) = resume_notes(ckpt, cfg)
    assert "built for learning_rate 0.01" in lr and "learning_rate 0.001 in this config has no effect" in lr
    same = parse_config(
        {
            **{"model_name_or_path": str(tmp_path / "m"), "dataset": str(tmp_path / "d.json")},
            "output_dir": str(tmp_path / "o"),
            "learning_rate": 1e-2,
        }
    )
    assert resume_notes(ckpt, same) == []


def test_resume_true_refuses_a_folder_holding_two_runs_checkpoints(tmp_path) -> None:
    """overwrite_output_dir leaves an earlier run's checkpoints; resume_from_checkpoint: true took the highest
    step, the earlier run's, without a word. A lower step whose logged history is not how the highest one's
    begins is another run's: refused, naming it."""
    import json

    from moetune.errors import CheckpointError
    from moetune.train.preflight import check_one_run

    def write(step: int, losses: list[float]) -> None:
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir(exist_ok=True)
        history = [{"step": i + 1, "loss": loss} for i, loss in enumerate(losses)]
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": history}))

    write(2, [3.0, 2.5])  # run A: steps 1-4
    write(4, [3.0, 2.5, 2.1, 1.9])
    check_one_run(tmp_path, tmp_path / "checkpoint-4")  # one run
    write(3, [3.1, 2.7, 2.4])  # run B, written over the folder: its own history
    with pytest.raises(
        CheckpointError, match=r"would take .*checkpoint-4.* but the logged history of checkpoint-3 is"
    ):
        check_one_run(tmp_path, tmp_path / "checkpoint-4")


def test_token_ids_past_the_embedding_are_refused_before_the_load(tmp_path) -> None:
    """A tokenizer with tokens added after the checkpoint was saved: the embedding lookup raised IndexError once
    the model had loaded; the prepared rows are checked against the planned model's embedding first."""
    from types import SimpleNamespace

    import torch
    from datasets import Dataset

    from moetune.errors import DataError
    from moetune.train.preflight import check_token_ids

    planned = SimpleNamespace(model=SimpleNamespace(get_input_embeddings=lambda: torch.nn.Embedding(10, 2)))
    small, large = [0] * 10, [0] * 12  # len() of a tokenizer the size of the embedding / with 2 added tokens
    fine = SimpleNamespace(train=Dataset.from_dict({"input_ids": [[1, 9], [2]]}), eval=None)
    check_token_ids(large, fine, planned)  # an added token no row uses: nothing to refuse
    past = SimpleNamespace(train=fine.train, eval=Dataset.from_dict({"chosen_input_ids": [[3, 11]]}))
    with pytest.raises(
        DataError, match=r"the evaluation rows hold token id 11, but the model's embedding has 10"
    ):
        check_token_ids(large, past, planned)
    check_token_ids(small, past, planned)  # no larger tokenizer: the rows are not read


def test_a_lora_checkpoint_resumed_under_full_names_the_mode(tmp_path) -> None:
    """transformers failed on it after the model loaded ("Can't find a checkpoint index"); refused first."""
    import json

    from moetune.config import parse_config
    from moetune.train.preflight import checkpoint_problems

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "d.json").write_text('[{"instruction": "a", "output": "b"}]')
    raw = {
        "model_name_or_path": str(tmp_path / "m"),
        "dataset": str(tmp_path / "d.json"),
        "output_dir": str(tmp_path / "o"),
    }
    ckpt = tmp_path / "checkpoint-2"
    ckpt.mkdir()
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
    (ckpt / "adapter_config.json").write_text("{}")
    for method in ("full", "freeze"):
        (problem,) = checkpoint_problems(ckpt, parse_config({**raw, "finetuning_type": method}), None)
        assert (
            f"a LoRA run's checkpoint (adapter_config.json, no model weights) and this config trains finetuning_type {method}"
            in problem
        )
    (ckpt / "model.safetensors.index.json").write_text("{}")  # a full run's, beside an adapter: not this case
    assert checkpoint_problems(ckpt, parse_config({**raw, "finetuning_type": "full"}), None) == []
