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
