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
