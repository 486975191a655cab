"""moetune.atomic: a failed write leaves the previous file and no leftover; folders are swapped whole."""

from __future__ import annotations

import os

import pytest

from moetune.atomic import recover_folder, replace_folder, temp_path, write_atomically, write_text_atomically


def test_a_failed_write_keeps_the_old_file_and_removes_the_temporary(tmp_path):
    target = tmp_path / "summary.json"
    write_text_atomically(target, "old")

    def fail(tmp):
        tmp.write_text("half")
        raise OSError("disk full (injected)")

    with pytest.raises(OSError, match="injected"):
        write_atomically(target, fail)
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_a_crash_leftover_is_overwritten_by_the_rerun(tmp_path):
    target = tmp_path / "shard.safetensors"
    temp_path(target).write_text("left by a killed process")
    write_text_atomically(target, "new", durable=False)
    assert target.read_text() == "new" and not temp_path(target).exists()


def test_replace_folder_swaps_a_complete_folder_in(tmp_path):
    final, staged = tmp_path / "checkpoint-2", tmp_path / "staging"
    final.mkdir()
    (final / "old.bin").write_text("old")
    staged.mkdir()
    (staged / "new.bin").write_text("new")
    replace_folder(staged, final, aside=tmp_path / "aside")
    assert sorted(p.name for p in final.iterdir()) == ["new.bin"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2"]


@pytest.mark.parametrize(
    "state, survivor",
    [
        ("killed while staging", "old"),
        ("killed between the two renames", "old"),
        ("killed before the aside was removed", "new"),
    ],
)
def test_recover_folder_leaves_one_whole_folder(tmp_path, state, survivor):
    final, staged, aside = tmp_path / "store", tmp_path / ".store.staged", tmp_path / ".store.aside"
    for folder, text in ((final, "old"), (staged, "new")):
        folder.mkdir()
        (folder / "f").write_text(text)
    if state == "killed between the two renames":
        os.rename(final, aside)
    elif state == "killed before the aside was removed":
        os.rename(final, aside)
        os.rename(staged, final)
    assert recover_folder(final, staged, aside)
    assert (final / "f").read_text() == survivor
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]
    assert recover_folder(final, staged, aside) == []
