"""A child process that a test starts finds this checkout and the packages its parent found through PYTHONPATH.

On the device machine the packages the image lacks are installed with ``pip install --target DIR`` and found
through ``PYTHONPATH=DIR``; the distributed and kill tests once replaced that variable with the checkout
alone, so their children imported the image's older transformers and failed.
"""

from __future__ import annotations

import os
import subprocess
import sys

from moetune.testing.child import ROOT, child_env


def test_the_checkout_comes_first_and_the_inherited_path_stays(monkeypatch) -> None:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["/opt/a", "/opt/b"]))
    env = child_env(OMP_NUM_THREADS="1")
    assert env["PYTHONPATH"].split(os.pathsep) == [str(ROOT), "/opt/a", "/opt/b"]
    assert env["OMP_NUM_THREADS"] == "1"


def test_without_an_inherited_path_only_the_checkout(monkeypatch) -> None:
    monkeypatch.delenv("PYTHONPATH", raising=False)
    assert child_env()["PYTHONPATH"] == str(ROOT)


def test_a_child_imports_a_package_found_only_through_the_parents_path(tmp_path, monkeypatch) -> None:
    (tmp_path / "beside_the_image.py").write_text("WHERE = __file__\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    code = "import beside_the_image, moetune; print(beside_the_image.WHERE); print(moetune.__file__)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=child_env(),
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path.parent,
    )
    where, moetune_file = out.stdout.split()
    assert where == str(tmp_path / "beside_the_image.py")
    assert moetune_file.startswith(str(ROOT))
