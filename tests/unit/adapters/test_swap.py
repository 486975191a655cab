"""moetune.adapters.swap: an adapter's config and weights are replaced together, whatever point a kill hits.

Every state a kill can leave (one per step of ``save_pair``, plus what older versions left) is built on disk,
then ``recover_adapter`` must leave one whole pair, old or new, never a mix, and keep the folder's other
files; a save after it must succeed.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from moetune.adapters.swap import (
    COMMITTED,
    CONFIG_NAME,
    FILES,
    LORA_EXPERTS_NAME,
    PARTIAL,
    WEIGHTS_NAME,
    recover_adapter,
    save_pair,
)


def _save(folder: Path, version: str) -> None:
    save_pair(folder, f'{{"version": "{version}"}}\n', lambda p: p.write_bytes(f"weights {version}".encode()))


def _pair(folder: Path) -> tuple[str, str]:
    config = (folder / CONFIG_NAME).read_text().split('"')[3]
    weights = (folder / WEIGHTS_NAME).read_bytes().decode().split()[1]
    return config, weights


@pytest.fixture
def out(tmp_path) -> Path:
    folder = tmp_path / "out"
    _save(folder, "old")
    (folder / "tokenizer.json").write_text("{}")  # a moetune train output_dir holds more than the adapter
    return folder


def _staged(folder: Path, name: str, version: str = "new") -> Path:
    staged = folder / name
    staged.mkdir()
    (staged / CONFIG_NAME).write_text(f'{{"version": "{version}"}}\n')
    (staged / WEIGHTS_NAME).write_bytes(f"weights {version}".encode())
    return staged


def _kill_after_commit(folder: Path) -> None:
    _staged(folder, COMMITTED)


def _kill_after_old_config_removed(folder: Path) -> None:
    _staged(folder, COMMITTED)
    (folder / CONFIG_NAME).unlink()


def _kill_between_the_two_moves(folder: Path) -> None:
    new = _staged(folder, COMMITTED)
    (folder / CONFIG_NAME).unlink()
    os.replace(new / WEIGHTS_NAME, folder / WEIGHTS_NAME)


def _kill_before_the_last_removal(folder: Path) -> None:
    new = _staged(folder, COMMITTED)
    for name in (WEIGHTS_NAME, CONFIG_NAME):
        os.replace(new / name, folder / name)


def _kill_while_staging(folder: Path) -> None:
    (folder / PARTIAL).mkdir()
    (folder / PARTIAL / WEIGHTS_NAME).write_bytes(b"half of the new wei")


STATES = {
    "while staging": (_kill_while_staging, "old"),
    "right after the commit rename": (_kill_after_commit, "new"),
    "after the old config was removed": (_kill_after_old_config_removed, "new"),
    "between the two moves": (_kill_between_the_two_moves, "new"),
    "before the staging folder was removed": (_kill_before_the_last_removal, "new"),
}


@pytest.mark.parametrize("state", STATES)
def test_recovery_leaves_one_whole_pair(out, state):
    make, expected = STATES[state]
    make(out)
    assert recover_adapter(out)  # something was done, and said
    assert _pair(out) == (expected, expected)
    assert sorted(p.name for p in out.iterdir()) == [CONFIG_NAME, WEIGHTS_NAME, "tokenizer.json"]
    assert recover_adapter(out) == []  # nothing left to do
    _save(out, "newer")
    assert _pair(out) == ("newer", "newer")


def test_the_mixed_state_has_no_config_so_no_loader_pairs_old_and_new(out):
    _kill_between_the_two_moves(out)  # the one moment new weights sit beside no new config
    assert not (out / CONFIG_NAME).exists()


def test_a_failed_write_keeps_the_old_pair_and_leaves_nothing(out):
    def fail(path: Path) -> None:
        path.write_bytes(b"half")
        raise OSError("disk full (injected)")

    with pytest.raises(OSError, match="injected"):
        save_pair(out, "{}", fail)
    assert _pair(out) == ("old", "old")
    assert sorted(p.name for p in out.iterdir()) == [CONFIG_NAME, WEIGHTS_NAME, "tokenizer.json"]


def test_leftovers_of_older_versions_are_cleaned_and_a_moved_aside_adapter_restored(tmp_path):
    out = tmp_path / "out"
    _save(out, "old")
    aside = tmp_path / ".out.tmp-k3j2-old"
    os.rename(out, aside)  # older save_adapter, killed between its two folder renames
    _staged(tmp_path, ".out.tmp-k3j2")
    assert not out.exists()
    recover_adapter(out)
    assert _pair(out) == ("old", "old") and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    (out / (WEIGHTS_NAME + ".tmp")).write_bytes(b"half")  # older in-place save, killed mid-file
    recover_adapter(out)
    assert sorted(p.name for p in out.iterdir()) == [CONFIG_NAME, WEIGHTS_NAME]


def test_nothing_interrupted_changes_nothing(out):
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert recover_adapter(out) == [] and recover_adapter(out.parent / "absent") == []
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    shutil.rmtree(out)


def _save_with_extra(folder: Path, version: str, extra: bool) -> None:
    optional = {LORA_EXPERTS_NAME: lambda p: p.write_text(f"experts {version}")} if extra else {}
    save_pair(
        folder,
        f'{{"version": "{version}"}}\n',
        lambda p: p.write_bytes(f"weights {version}".encode()),
        optional,
    )


@pytest.mark.parametrize(("old_extra", "new_extra"), [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("moved", range(4))
def test_an_optional_file_is_part_of_the_commit(tmp_path, old_extra, new_extra, moved) -> None:
    """The LoRA-experts file goes with its adapter: a kill after the commit, with any number of the committed
    files already moved (the config last), is rolled forward to the new set, and an old adapter's file the new
    one lacks is gone (never paired with the new adapter)."""
    folder = tmp_path / "out"
    _save_with_extra(folder, "old", old_extra)
    _save_with_extra(tmp_path / "staging", "new", new_extra)  # the files the new commit holds
    (tmp_path / "staging" / FILES).write_text(
        json.dumps([WEIGHTS_NAME, *([LORA_EXPERTS_NAME] if new_extra else []), CONFIG_NAME])
    )
    (tmp_path / "staging").rename(folder / COMMITTED)
    names = json.loads((folder / COMMITTED / FILES).read_text())
    if moved:  # the roll-forward had begun: old config and stale optional removed, `moved` files moved
        (folder / CONFIG_NAME).unlink()
        if not new_extra:
            (folder / LORA_EXPERTS_NAME).unlink(missing_ok=True)
        for name in names[: moved - 1]:
            os.replace(folder / COMMITTED / name, folder / name)
    recover_adapter(folder)
    assert _pair(folder) == ("new", "new")
    assert (folder / LORA_EXPERTS_NAME).is_file() == new_extra
    if new_extra:
        assert (folder / LORA_EXPERTS_NAME).read_text() == "experts new"
    assert not (folder / COMMITTED).exists()
