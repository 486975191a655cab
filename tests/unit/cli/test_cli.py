"""The ``moetune`` command: every subcommand registers, --help works, errors exit 2 with the message."""

from __future__ import annotations

import subprocess
import sys

import pytest

from moetune.cli.main import SUBCOMMANDS, build_parser, main


def test_every_subcommand_has_help(capsys):
    parser = build_parser()
    for name in SUBCOMMANDS:
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args([name, "--help"] if name != "bench" else ["bench", "engine", "--help"])
        assert exit_info.value.code == 0
        assert "usage: moetune" in capsys.readouterr().out


def test_console_script_starts_fast_and_lists_commands():
    out = subprocess.run(
        [sys.executable, "-m", "moetune.cli.main", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for name in SUBCOMMANDS:
        assert name in out


def test_user_error_exits_2_with_message(capsys, tmp_path):
    rc = main(["bench", "engine", "--quick", "--json", str(tmp_path / "missing" / "out.json")])
    assert rc == 2
    assert "does not exist" in capsys.readouterr().err
