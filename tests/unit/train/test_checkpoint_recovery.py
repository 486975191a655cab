"""What a kill during a checkpoint save or a full model save leaves in output_dir is undone at the next start
(``moetune.train.checkpoints.recover_checkpoints``, ``moetune.train.model_save.recover_model_save``): no whole
checkpoint is lost, no staging folder stays."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from transformers import trainer_utils

from moetune.train import checkpoints
from moetune.train.checkpoints import recover_checkpoints, rotate_checkpoints
from moetune.train.model_save import recover_model_save


def _checkpoint(folder: Path, tag: str) -> Path:
    folder.mkdir(parents=True)
    (folder / "adapter_model.safetensors").write_text(tag)
    (folder / "optimizer.pt").write_text(tag)
    return folder


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


def test_an_unfinished_save_is_removed_and_the_checkpoints_kept(tmp_path) -> None:
    _checkpoint(tmp_path / "checkpoint-2", "2")
    _checkpoint(tmp_path / "tmp-checkpoint-3" / "checkpoint-3", "partial")  # killed while writing step 3
    (tmp_path / "adapter_model.safetensors").write_text("final")  # other files of the run stay
    done = recover_checkpoints(tmp_path)
    assert _tree(tmp_path) == {
        "adapter_model.safetensors": "final",
        "checkpoint-2/adapter_model.safetensors": "2",
        "checkpoint-2/optimizer.pt": "2",
    }
    assert any("tmp-checkpoint-3" in line for line in done)


def test_a_kill_between_the_two_renames_restores_the_previous_checkpoint(tmp_path) -> None:
    """A resumed run re-saving step 4: the old checkpoint-4 was moved aside, the new one not yet renamed in."""
    _checkpoint(tmp_path / "tmp-checkpoint-4" / "replaced", "old 4")
    _checkpoint(tmp_path / "tmp-checkpoint-4" / "checkpoint-4", "new 4")
    recover_checkpoints(tmp_path)
    assert _tree(tmp_path) == {
        "checkpoint-4/adapter_model.safetensors": "old 4",
        "checkpoint-4/optimizer.pt": "old 4",
    }


def test_nothing_interrupted_changes_nothing(tmp_path) -> None:
    _checkpoint(tmp_path / "checkpoint-1", "1")
    (tmp_path / "tmp-notes").mkdir()  # not a checkpoint staging folder
    before = _tree(tmp_path)
    assert recover_checkpoints(tmp_path) == [] and _tree(tmp_path) == before
    assert (tmp_path / "tmp-notes").is_dir()
    assert recover_checkpoints(tmp_path / "missing") == []


def test_an_interrupted_model_save_leaves_no_staging_folder(tmp_path) -> None:
    (tmp_path / "model.safetensors").write_text("whole")
    _checkpoint(tmp_path / ".model.tmp-ab12cd", "partial")  # save_model's staging, killed before its renames
    (tmp_path / ".model.tmp-notes").write_text("a file of that name is not a staging folder")
    done = recover_model_save(tmp_path)
    assert _tree(tmp_path) == {
        "model.safetensors": "whole",
        ".model.tmp-notes": "a file of that name is not a staging folder",
    }
    assert len(done) == 1 and recover_model_save(tmp_path) == [] and recover_model_save(tmp_path / "no") == []


def _run_dir(root: Path, steps: range) -> Path:
    """checkpoint-N for each step, modified in step order (rotation keeps the newest by mtime)."""
    for step in steps:
        folder = _checkpoint(root / f"checkpoint-{step}", str(step))
        os.utime(folder, (1_000_000 + step, 1_000_000 + step))
    return root


@pytest.mark.parametrize(
    ("limit", "best"),
    [(None, None), (0, None), (1, None), (2, None), (3, None), (2, 2), (1, 3), (2, 5), (6, 1)],
)
def test_rotation_keeps_what_transformers_keeps(tmp_path, limit, best) -> None:
    """The checkpoints kept are those transformers' own rotate_checkpoints(use_mtime=True) keeps."""
    ours, theirs = _run_dir(tmp_path / "ours", range(1, 6)), _run_dir(tmp_path / "theirs", range(1, 6))
    best_of = {d: None if best is None else str(d / f"checkpoint-{best}") for d in (ours, theirs)}
    dropped = rotate_checkpoints(str(ours), limit, best_of[ours])
    trainer_utils.rotate_checkpoints(str(theirs), limit, best_of[theirs], use_mtime=True)
    assert sorted(os.listdir(ours)) == sorted(os.listdir(theirs))
    assert sorted(Path(p).name for p in dropped) == sorted(
        f"checkpoint-{s}" for s in range(1, 6) if not (theirs / f"checkpoint-{s}").exists()
    )


def test_a_kill_while_rotation_deletes_leaves_no_partial_checkpoint(tmp_path, monkeypatch) -> None:
    """transformers deletes a rotated-out checkpoint-N in place, so a kill mid-delete left checkpoint-N without its
    adapter; here it is renamed out of sight first and the next start clears what the kill left."""
    run = _run_dir(tmp_path, range(1, 5))
    real_rmtree = shutil.rmtree

    def killed_mid_delete(path, ignore_errors=False):
        path = Path(path)
        if path.exists():  # the delete of the renamed checkpoint: one file goes, then the process dies
            (path / "adapter_model.safetensors").unlink()
            raise KeyboardInterrupt

    monkeypatch.setattr(checkpoints.shutil, "rmtree", killed_mid_delete)
    with pytest.raises(KeyboardInterrupt):
        rotate_checkpoints(str(run), 2, None)
    monkeypatch.setattr(checkpoints.shutil, "rmtree", real_rmtree)
    assert sorted(p.name for p in run.iterdir()) == [
        "checkpoint-2",
        "checkpoint-3",
        "checkpoint-4",
        "tmp-removed-checkpoint-1",
    ]
    for step in (2, 3, 4):  # every visible checkpoint is whole
        assert _tree(run / f"checkpoint-{step}") == {
            "adapter_model.safetensors": str(step),
            "optimizer.pt": str(step),
        }
    done = recover_checkpoints(run)
    assert len(done) == 1 and "tmp-removed-checkpoint-1" in done[0]
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint-2", "checkpoint-3", "checkpoint-4"]
